"""The control-flow rules of sown names, which `reap` and `plant` both enforce:
what each mode may do inside `scan`, `while_loop` and `cond`. Each check names
the sow's and the control flow's source lines."""

from __future__ import annotations

from collections.abc import Collection

from jax.extend.core import JaxprEqn

from kups.effects import source_line

from ._names import SowPath, Tag, describe, path_of
from ._reaped import init_of


def check_scan(tag: Tag, sows: list[JaxprEqn], eqn: JaxprEqn) -> None:
    """A strict name cannot be sown inside a scan: it would be sown once per iteration."""
    for sow_eqn in sows:
        if sow_eqn.params["mode"] == "strict":
            raise ValueError(
                f"{describe(tag, path_of(sow_eqn))} is sown with mode='strict' at "
                f"{source_line(sow_eqn)}, inside the scan at {source_line(eqn)}, so it would "
                f"be sown once per iteration. Use mode='append' to get one value per "
                f"iteration, or mode='clobber' to get the last iteration's value."
            )


def check_while(tag: Tag, sows: list[JaxprEqn], eqn: JaxprEqn) -> None:
    """Only clobber names (and `sow_cond`) may be sown inside a while loop."""
    for sow_eqn in sows:
        path, mode = path_of(sow_eqn), sow_eqn.params["mode"]
        if mode == "clobber":
            continue
        where = f"at {source_line(sow_eqn)}, inside the while_loop at {source_line(eqn)}"
        if mode == "append":
            raise ValueError(
                f"{describe(tag, path)} is sown with mode='append' {where}. A while loop "
                f"has no static number of iterations to stack along: use a scan "
                f"(or fori_loop with static bounds), or mode='clobber' for the last "
                f"value."
            )
        if mode == "strict":
            raise ValueError(
                f"{describe(tag, path)} is sown with mode='strict' {where}, so it would be "
                f"sown once per iteration. Use mode='clobber' for the last value (and "
                f"sow an initial value before the loop, or give the sow init=)."
            )


def check_cond(
    tag: Tag, branches: list[dict[SowPath, JaxprEqn]], eqn: JaxprEqn, known: Collection[SowPath]
) -> None:
    """A name not `known` before the cond must be sown by every branch."""
    new_paths = sorted({path for paths in branches for path in paths} - set(known))
    for path in new_paths:
        with_it = [i for i, paths in enumerate(branches) if path in paths]
        without = [i for i, paths in enumerate(branches) if path not in paths]
        if without:
            where = ", ".join(f"{i} (at {source_line(branches[i][path])})" for i in with_it)
            raise ValueError(
                f"{describe(tag, path)} is sown in branch {where} of the cond/switch at "
                f"{source_line(eqn)} but not in branch {', '.join(map(str, without))} (the "
                f"branches of lax.cond are 0: false_fun, 1: true_fun). The "
                f"taken branch's value is reaped, so when a branch that does not sow "
                f"it runs, the name has no value; kups does not invent one. Sow it in "
                f"every branch (same shape and dtype), give the sow "
                f"mode='clobber' and init=<number> (the value when a branch that does "
                f"not sow it runs), or sow an initial value with mode='clobber' before "
                f"the cond."
            )


def given_by_init(
    tag: Tag, branches: list[list[JaxprEqn]], known: Collection[SowPath]
) -> list[tuple[SowPath, JaxprEqn]]:
    """The names not `known` before a cond that some branch does not sow, whose
    value then is their sows' `init` (every sow of the name in the branches is an
    unconditional clobber), each with the sow that gives the `init`."""
    given = []
    for path in sorted({path_of(e) for sows in branches for e in sows} - set(known)):
        if all(any(path_of(e) == path for e in sows) for sows in branches):
            continue
        in_branches = [e for sows in branches for e in sows if path_of(e) == path]
        init = init_of(tag, path, in_branches)
        if init is not None and all(
            e.params["mode"] == "clobber" and not e.params["conditional"] for e in in_branches
        ):
            given.append((path, init))
    return given
