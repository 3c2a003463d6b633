"""Step time of ranks sharing cores (core/cpu_model.py)."""

import numpy as np
import pytest

from copus.core.cpu_model import SharedCoreStepTimeModel
from copus.core.fit import fit_model, prior_model
from copus.core.models import get_model_shape
from copus.core.plan import ParallelPlan

SHAPE = get_model_shape("tiny")
BASE = prior_model(SHAPE, None, 4)


def _shared(cores):
    return SharedCoreStepTimeModel(BASE.params, SHAPE, None, cores=cores, world_size=4,
                                   dtype_bytes=BASE.dtype_bytes)


def test_enough_cores_is_the_base_model_and_too_few_spread_the_work():
    cols = [np.array(v) for v in ([4, 1, 2], [1, 1, 1], [1, 4, 2], [2, 2, 2], [4, 8, 4])]
    base = BASE.breakdown(*cols)
    assert np.allclose(_shared(4).predict(*cols), base["step_s"], rtol=1e-12)
    two = _shared(2).breakdown(*cols)
    busy = base["step_s"] - base["bubble_s"]
    assert np.allclose(two["step_s"], np.maximum(base["step_s"], 2 * busy), rtol=1e-12)
    assert two["step_s"][0] == pytest.approx(2 * base["step_s"][0], rel=1e-12)   # dp4: 2x
    # pp4 with 8 micro-batches: its 3 bubble stage-times are absorbed by the shared cores
    assert two["step_s"][1] < 2 * base["step_s"][1]


def test_fit_keeps_the_shared_core_structure_and_prior_model_picks_it():
    plans = [ParallelPlan(dp=4, tp=1, pp=1, micro_batch_size=2, num_microbatches=1),
             ParallelPlan(dp=1, tp=1, pp=4, micro_batch_size=2, num_microbatches=4)]
    truth = _shared(2).with_params(BASE.params.scaled_time(3.0))
    fitted = fit_model([(p, truth.predict_plan(p)) for p in plans], _shared(2))
    assert isinstance(fitted, SharedCoreStepTimeModel) and fitted.cores == 2
    assert all(fitted.predict_plan(p) == pytest.approx(truth.predict_plan(p), rel=0.02) for p in plans)
    assert isinstance(prior_model(SHAPE, None, 4, cores=2), SharedCoreStepTimeModel)
    assert not isinstance(prior_model(SHAPE, None, 4, cores=4), SharedCoreStepTimeModel)
    with pytest.raises(ValueError, match="cores=0"):
        SharedCoreStepTimeModel(BASE.params, SHAPE, None, cores=0)
