"""Render the public API's docstrings as Markdown: `python tools/gen_api_docs.py > docs/api.md`."""

from __future__ import annotations

import importlib
import inspect

MODULES = {
    "copus.adapt": ["AdaptiveBatch"],
    "copus.core.stats.gns": ["two_batch_estimate", "DecaySchedule", "GnsEstimator"],
    "copus.core.stats.efficiency": None,
    "copus.core.stats.batch_tests": None,
    "copus.core.plan.plan": ["ParallelPlan", "plan_problems", "layouts", "enumerate_plans"],
    "copus.core.plan.records": ["StepRecord", "Decision", "Candidate"],
    "copus.core.control.policies": ["PolicySettings", "make_policy", "POLICY_NAMES"],
}


def _members(mod, names):
    if names is None:
        names = [
            n
            for n, v in vars(mod).items()
            if not n.startswith("_") and inspect.isfunction(v) and v.__module__ == mod.__name__
        ]
    return [(n, getattr(mod, n)) for n in names if hasattr(mod, n)]


def render() -> str:
    out = [
        "# copus API reference",
        "",
        "Generated from the docstrings by `python tools/gen_api_docs.py > docs/api.md`.",
        "",
    ]
    for mod_name, names in MODULES.items():
        mod = importlib.import_module(mod_name)
        out += [f"## `{mod_name}`", "", inspect.cleandoc(mod.__doc__ or ""), ""]
        for name, obj in _members(mod, names):
            if inspect.isclass(obj) or inspect.isfunction(obj):
                try:
                    sig = str(inspect.signature(obj))
                except (TypeError, ValueError):
                    sig = "(...)"
                out += [f"### `{name}{sig}`", "", inspect.cleandoc(obj.__doc__ or ""), ""]
                if inspect.isclass(obj):
                    for mname, meth in vars(obj).items():
                        if mname.startswith("_") or not (inspect.isfunction(meth) or isinstance(meth, property)):
                            continue
                        doc = inspect.cleandoc((meth.fget if isinstance(meth, property) else meth).__doc__ or "")
                        if doc:
                            out += [f"- `{name}.{mname}`: " + doc.replace("\n", " "), ""]
            else:
                out += [f"### `{name}` = `{obj!r}`", ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(render())
