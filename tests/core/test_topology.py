import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from copus.core.specs import hardware
from copus.core.specs.topology import (
    NodeTopology,
    crosses_nodes,
    crossing_dims,
    groups,
    launched_hardware,
    node_topology_from_env,
    nodes_spanned,
    profile_overrides,
)

TORCHRUN_2x4 = dict(
    WORLD_SIZE="8",
    LOCAL_WORLD_SIZE="4",
    GROUP_WORLD_SIZE="2",
    ROLE_WORLD_SIZE="8",
    GROUP_RANK="1",
    RANK="5",
    LOCAL_RANK="1",
)


def test_torchrun_two_nodes_of_four():
    t = node_topology_from_env(TORCHRUN_2x4)
    assert (t.world_size, t.gpus_per_node, t.num_nodes, t.node_rank) == (8, 4, 2, 1)
    assert t.multi_node and t.node_of(3) == 0 and t.node_of(4) == 1


def test_no_launcher_is_one_node_holding_everything():
    t = node_topology_from_env({}, world_size=4)
    assert (t.world_size, t.gpus_per_node, t.num_nodes) == (4, 4, 1) and not t.multi_node
    assert node_topology_from_env({}).world_size == 1


def test_missing_group_world_size_is_derived():
    t = node_topology_from_env(dict(WORLD_SIZE="6", LOCAL_WORLD_SIZE="2"))
    assert (t.gpus_per_node, t.num_nodes) == (2, 3)
    t = node_topology_from_env(dict(ROLE_WORLD_SIZE="6", GROUP_WORLD_SIZE="3"))
    assert (t.world_size, t.gpus_per_node, t.num_nodes) == (6, 2, 3)


@pytest.mark.parametrize(
    "env,match",
    [
        (dict(WORLD_SIZE="7", LOCAL_WORLD_SIZE="4", GROUP_WORLD_SIZE="2"), "nproc-per-node"),
        (dict(WORLD_SIZE="6", LOCAL_WORLD_SIZE="4"), "not a multiple"),
        (dict(WORLD_SIZE="two"), "WORLD_SIZE='two'"),
        (dict(WORLD_SIZE="0"), "WORLD_SIZE='0'"),
    ],
)
def test_inconsistent_environment_is_a_value_error(env, match):
    with pytest.raises(ValueError, match=match):
        node_topology_from_env(env)


def test_resized_keeps_gpus_per_node():
    t = node_topology_from_env(TORCHRUN_2x4).resized(4)
    assert (t.world_size, t.gpus_per_node, t.num_nodes) == (4, 4, 1)
    with pytest.raises(ValueError, match="multiple of gpus_per_node=4"):
        t.resized(6)


def test_groups_follow_mesh_order_pp_dp_tp():
    # dp=2, tp=2, pp=2: rank = (pp*dp + dp_idx)*tp + tp_idx
    assert groups("tp", 2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups("dp", 2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups("pp", 2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_known_layouts_on_two_nodes_of_four():
    assert crossing_dims(2, 4, 1, 4) == ("dp",)  # tp inside a node, dp across
    assert crossing_dims(1, 8, 1, 4) == ("tp",)  # tp=8 must cross
    assert crossing_dims(4, 1, 2, 4) == ("pp",)  # pipeline hop between nodes
    assert crossing_dims(8, 1, 1, 8) == ()  # one node
    assert crossing_dims(2, 1, 1, 1) == ("dp",)  # one worker per node (the netns test)
    assert nodes_spanned("tp", 1, 8, 1, 4) == 2 and nodes_spanned("tp", 2, 4, 1, 4) == 1


def test_tp_of_three_on_nodes_of_four_crosses():
    assert bool(crosses_nodes("tp", 4, 3, 1, 4))  # groups {3,4,5} straddle ranks 3|4
    assert not bool(crosses_nodes("tp", 1, 3, 1, 4))  # world 3 fits in one node


def test_vectorised_over_candidate_arrays():
    tp = np.array([1, 2, 4, 8])
    out = crosses_nodes("tp", 8 // tp, tp, 1, 4)
    assert out.tolist() == [False, False, False, True]


def test_bad_dim_and_gpus_per_node():
    with pytest.raises(ValueError, match="dim='ep'"):
        crosses_nodes("ep", 1, 1, 1, 1)
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        crosses_nodes("tp", 1, 2, 1, 0)
    with pytest.raises(ValueError, match="world_size=8 must equal"):
        NodeTopology(world_size=8, gpus_per_node=3, num_nodes=2)


layout = st.tuples(st.integers(1, 6), st.integers(1, 6), st.integers(1, 4), st.integers(1, 12))


@given(layout)
def test_closed_form_equals_explicit_groups(x):
    dp, tp, pp, gpn = x
    for dim in ("tp", "dp", "pp"):
        explicit = nodes_spanned(dim, dp, tp, pp, gpn) > 1
        assert bool(crosses_nodes(dim, dp, tp, pp, gpn)) == explicit, (dim, x)


@given(layout)
def test_agrees_with_the_step_time_models_topology(x):
    dp, tp, pp, gpn = x
    topo = hardware.Topology(world_size=dp * tp * pp, gpus_per_node=gpn)
    for dim in ("tp", "dp", "pp"):
        assert topo.crosses_nodes(dim, dp, tp, pp) == bool(crosses_nodes(dim, dp, tp, pp, gpn))


def test_profile_overrides_keep_a_valid_profile():
    topo = node_topology_from_env(dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_WORLD_SIZE="2"))
    h100 = next(iter(hardware.HARDWARE.values()))
    prof = hardware.with_overrides(h100, **profile_overrides(topo, h100.nvlink_group))
    assert prof.gpus_per_node == 2 and prof.gpus_per_node % prof.nvlink_group == 0


def test_launched_hardware_prices_cross_node_tp_with_the_network():
    from copus.core.specs.resolve import get_model_shape
    from copus.core.cost.throughput import StepTimeModel

    h100 = hardware.get_hardware("h100-sxm")
    assert launched_hardware(h100, {}) is h100  # not launched: unchanged
    env = dict(WORLD_SIZE="16", LOCAL_WORLD_SIZE="8", GROUP_WORLD_SIZE="2")
    hw = launched_hardware(h100, env)
    assert (hw.gpus_per_node, hw.nvlink_group) == (8, 8)
    shape = get_model_shape("tinyllama-1.1b")
    # the same 16 ranks on nodes of 8 (from the launcher) vs nodes of 4: tp=8 crosses only on 4
    small = launched_hardware(h100, dict(WORLD_SIZE="16", LOCAL_WORLD_SIZE="4"))
    t8 = StepTimeModel.analytic(shape, hw).tiers(2, 8, 1)[0]
    t4 = StepTimeModel.analytic(shape, small).tiers(2, 8, 1)[0]
    assert int(t8) == 0 and int(t4) == 2
    s8 = StepTimeModel.analytic(shape, hw).predict(2, 8, 1, 1, 8)
    s4 = StepTimeModel.analytic(shape, small).predict(2, 8, 1, 1, 8)
    assert float(s4) > float(s8)  # tensor parallelism over the network is slower
