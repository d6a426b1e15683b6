"""What the receipts of a :class:`~svtoolkit.memory.ForgettableMemory` certify, and how.

A receipt of a forget or a key edit carries the solver's KKT residual at a verification level -
recomputed from the keys (``"fresh"``, O(n |support| d)) or evaluated on the gradients the walk
maintains (``"maintained"``, O(n)), once per solver state - the digests before and after, the
deviation from a from-scratch solve when asked, and a MAC when the memory has a signing key.
:meth:`ForgettableMemory.load` chooses its level by the same measure of work (:func:`fresh_work`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from .._validation import check_option
from ..exact import IncrementalSVDD
from ._receipts import DeletionReceipt
from ._signing import receipt_mac

__all__ = ["VERIFY_LEVELS", "check_verify", "fresh_work", "maintained_kkt", "kkt_residual",
           "fresh_deviation", "receipt"]

#: The levels :meth:`ForgettableMemory.load` accepts.
VERIFY_LEVELS = ("auto", "full", "maintained")


def check_verify(verify, allowed=(True, False, "auto", "full", "maintained")):
    """The verification level ``verify`` names (``True`` is ``"auto"``); refuse others."""
    verify = check_option(verify, "verify", allowed)
    return "auto" if verify is True else verify


def fresh_work(solver):
    """``n |support| d``: the multiply-adds of a fresh evaluation of every gradient."""
    n = solver._n
    return n * int(np.count_nonzero(solver._alpha[:n])) * (solver.n_features or 0)


def maintained_kkt(solver):
    """The KKT residual evaluated on the gradients the walk maintains (O(n))."""
    return float(solver._kkt_from(solver._grad[: solver._n])) if solver._n else 0.0


def kkt_residual(mem, verify, fresh_limit):
    """``(residual, kkt_source)`` of ``mem``'s solver for a receipt (see
    :class:`DeletionReceipt`).

    Computed once per solver state (``mem._kkt``): a value-only edit leaves the solver
    untouched and reuses the value (``"cached ..."``). ``"auto"`` recomputes every gradient
    from the keys when that costs at most ``fresh_limit`` multiply-adds (the memory's
    ``FRESH_KKT_WORK``), else uses the maintained ones.
    """
    if verify is False:
        return None, None
    if mem._kkt is not None and (verify != "full" or mem._kkt[1] == "fresh"):
        return mem._kkt[0], f"cached {mem._kkt[1]}"
    fresh = verify == "full" or (verify == "auto" and fresh_work(mem._solver) <= fresh_limit)
    if fresh:
        mem._kkt = (float(mem._solver.kkt_residual()), "fresh")
    else:
        mem._kkt = (maintained_kkt(mem._solver), "maintained")
    return mem._kkt


def fresh_deviation(solver, extra_probes=None):
    """Largest |f - f fresh| at the keys (and ``extra_probes``, shape (m, d)) against a
    from-scratch solve of the same keys with the same C."""
    keys = solver.keys
    fresh = IncrementalSVDD(solver.C, solver.sigma)
    fresh.extend(keys)
    probes = keys if extra_probes is None else np.vstack([keys, extra_probes])
    return float(np.max(np.abs(solver.decision_function(probes)
                               - fresh.decision_function(probes))))


def receipt(mem, operation, record_id, when, before, probes, audit, verify, checked,
            fresh_limit):
    """The :class:`DeletionReceipt` of ``mem``'s operation just applied (signed with its key).

    ``before`` is the digest before the operation, ``probes`` the keys it removed or added
    (where ``audit`` also compares with a fresh solve), ``checked`` the rolling audit's slice.
    """
    deviation = None
    if audit and len(mem._table):
        deviation = fresh_deviation(mem._solver, np.vstack(probes))
    kkt, source = kkt_residual(mem, verify, fresh_limit)
    made = DeletionReceipt(
        operation=operation,
        record_id=record_id,
        time=when,
        kkt_residual=kkt,
        kkt_source=source,
        rolling_audit=checked,
        digest_before=before,
        digest_after=mem.state_digest(),
        n_records=len(mem._table),
        certified=mem._solver.certified,
        audit_deviation=deviation,
        revision=mem._revision,
    )
    if mem._signing_key is None:
        return made
    return dataclasses.replace(made, mac=receipt_mac(mem._signing_key, made.signed_fields()))
