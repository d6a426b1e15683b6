"""The rolling audit: the solver's maintained quantities checked fresh, in slices.

The exact walk maintains the gradients of every key and the inverse of the bordered margin
system; later deletions build on them. :meth:`IncrementalSVDD.audit` compares all of them with
a fresh evaluation from the keys at once (O(n |support| d + m^3)), which at 10^5 records is
seconds for one operation. A memory runs the same comparison in slices instead, one every
``stride`` operations that changed the solver: a slice recomputes the gradients of the next
``ceil(n / P)`` keys (at least ``MIN_KEYS``) in solver-id order (a cursor that wraps) and
multiplies the next ``ceil((m + 1) / P)`` columns (at least ``MIN_COLUMNS``) of the bordered
system by the maintained inverse, where ``P = AUDIT_PERIOD // stride`` slices fall in one
period. Large memories (above 32,000 keys with the constants here) take a slice after every
operation; smaller ones take a slice of ``MIN_KEYS`` keys every ``stride`` operations (at most
``MAX_STRIDE``), so the fixed cost of a slice (gathering the support, the Python calls) is
spread over the operations instead of paid by each. Either way a key held for
``AUDIT_PERIOD`` operations has had its maintained gradient compared with a fresh one at least
once in them (solver ids never move; a memory that grows meanwhile stretches the cycle by the
keys it added). One key's fresh gradient sums a kernel term over every support record
(``|support| (d + KERNEL_TERM_COST)`` multiply-adds, :func:`key_work`: the distance and the
exponential), so where the slice of ``ceil(n / P)`` keys would cost more than ``AUDIT_WORK``
multiply-adds per operation (large memories with a large support: 100 keys against 30,006
support records of d = 16 took 22 ms, more than the rest of the change), a slice checks
``floor(AUDIT_WORK stride / key_work)`` keys (at least one) and the cycle grows past
``AUDIT_PERIOD`` instead: the audit's cost per change stays bounded and the guarantee becomes
"within ``stride ceil(n / keys)`` operations". A slice's fixed cost, gathering the support
(which reads the whole key buffer, :func:`gather_work`), takes at most half the budget: large
memories then take a larger slice every few operations. Every slice also compares rho
with the rho a fresh solve would report, which differs from the maintained one only while no
margin key is free (rho is then optimal anywhere in an interval, and a fresh solve reports its
midpoint; O(n) from the maintained gradients that the slices check). A slice whose drift or
rho offset exceeds the solver's own audit thresholds triggers the full audit, which
refactorises (the repair a periodic audit would make).
"""

from __future__ import annotations

import numpy as np

from ..exact.solver import AUDIT_GRAD_TOL, AUDIT_INVERSE_TOL

__all__ = ["AUDIT_PERIOD", "AUDIT_WORK", "RollingAudit", "gather_work", "key_work",
           "schedule"]

#: Every maintained gradient (and inverse column) is compared with a fresh evaluation at least
#: once per this many solver-changing operations - the period of the solver's own audit.
AUDIT_PERIOD = 1000
#: Fewest keys (bordered-system columns) one slice checks: below this a slice's fixed cost
#: (gathering the support once, the calls) outweighs its kernel rows.
MIN_KEYS = 64
MIN_COLUMNS = 4
#: Most operations between two slices, so a small memory still cycles within ~100 operations.
MAX_STRIDE = 64
#: What one fresh kernel term costs besides its d multiply-adds (the distance), in
#: multiply-adds: the exponential. Measured on the 2-core machine: a term of d = 16 took 13-20 ns
#: and one of d = 384 210 ns, 0.3-0.5 ns per multiply-add so counted.
KERNEL_TERM_COST = 24
#: Most multiply-adds of fresh kernel sums that the audit spends per solver-changing operation
#: (a key's fresh gradient costs :func:`key_work`, a slice's gather :func:`gather_work`): about
#: 2-3 ms on the 2-core machine (at 10^5 records with 30,006 in the support, d = 16: 9 keys
#: every third operation, where 100 keys after each took 22 ms).
AUDIT_WORK = 6 * 10**6
#: What reading one coordinate of a held key costs, in multiply-adds: a slice gathers the
#: support's keys from the solver's key buffer once, reading all of it (n d values: 3-4.5 ms
#: at 10^5 keys of d = 16 on the 2-core machine, whatever the number of keys checked).
GATHER_COST = 4


def key_work(support, d):
    """Multiply-adds of one key's fresh gradient: ``support (d + KERNEL_TERM_COST)``."""
    return support * (d + KERNEL_TERM_COST)


def gather_work(n, d):
    """Multiply-adds of a slice's fixed cost, gathering the support: ``GATHER_COST n d``."""
    return GATHER_COST * n * d


def schedule(n, m, work=0, gather=0):
    """``(stride, keys, columns)`` of the rolling audit for n keys and m margin keys.

    One slice every ``stride`` solver-changing operations checks ``keys`` gradients and
    ``columns`` columns of the (m + 1)-square bordered system, so every key and column is
    checked within ``AUDIT_PERIOD`` operations - unless checking that many keys would cost
    more than ``AUDIT_WORK`` multiply-adds per operation: then ``keys`` is the most that fit
    (at least one), and every key is checked within ``stride ceil(n / keys)`` operations.
    A slice's fixed cost ``gather`` takes at most half of that budget: a slice is then taken
    at most every ``ceil(2 gather / AUDIT_WORK)`` operations, its keys paid from the rest.

    Parameters
    ----------
    n, m : int
        Keys held, and keys in the margin set.
    work : int, default 0
        Multiply-adds of one key's fresh gradient, :func:`key_work` (0: no cap).
    gather : int, default 0
        Multiply-adds of one slice's fixed cost, :func:`gather_work` (counted only with a
        ``work``).
    """
    stride = min(MAX_STRIDE, max(1, AUDIT_PERIOD // max(1, -(-n // MIN_KEYS))))
    if work > 0:
        stride = min(MAX_STRIDE, max(stride, -(-2 * gather // AUDIT_WORK)))
    slices = AUDIT_PERIOD // stride
    keys = min(n, max(MIN_KEYS, -(-n // slices)))
    if work > 0:
        keys = min(keys, max(1, (AUDIT_WORK * stride - gather) // work))
    columns = min(m + 1, max(MIN_COLUMNS, -(-(m + 1) // slices))) if m else 0
    return stride, keys, columns


def _largest(values):
    """max |values| (0.0 when empty, inf when any is NaN)."""
    if values.size == 0:
        return 0.0
    top = float(np.max(np.abs(values)))
    return top if top == top else float("inf")


class RollingAudit:
    """Cursor of the rolling audit (next solver id, next bordered-system column, countdown).

    Parameters
    ----------
    next_id, next_column : int, default 0
        Where the next slice starts (restored from a memory file).
    wait : int, default 0
        Solver-changing operations still to pass before the next slice (0: the next one).
    """

    def __init__(self, next_id=0, next_column=0, wait=0):
        self.next_id = int(next_id)
        self.next_column = int(next_column)
        self.wait = int(wait)

    def cursor(self):
        """``[next_id, next_column, wait]`` (saved with the memory)."""
        return [self.next_id, self.next_column, self.wait]

    def step(self, solver, repair=True):
        """Count one solver-changing operation; run a slice when one is due.

        Parameters
        ----------
        solver : IncrementalSVDD
        repair : bool, default True
            Run the full audit (which refactorises) when the slice drifted past the solver's
            audit thresholds; False only measures (a loader refuses instead).

        Returns
        -------
        dict or None
            None when no slice was due; else ``gradients_checked``, ``grad_drift``,
            ``inverse_columns_checked``, ``inverse_residual``, ``rho_offset`` (|rho - the rho
            a fresh solve reports|, 0.0 while a free margin key fixes rho), ``repaired`` (see
            :class:`DeletionReceipt`).
        """
        if self.wait > 0:
            self.wait -= 1
            return None
        return self.slice(solver, repair)

    def slice(self, solver, repair=True):
        """Check the next slice of ``solver``'s maintained state now (see :meth:`step`)."""
        m = solver.margin_size
        d = solver.n_features or 0
        stride, n_keys, n_columns = schedule(len(solver), m, key_work(solver.support_size, d),
                                             gather_work(len(solver), d))
        self.wait = stride - 1
        chosen = self._next_ids(solver.ids, n_keys)
        cols = self._next_columns(m, n_columns)
        found = solver.audit_slice(chosen, cols)
        drift = _largest(found.maintained_gradients - found.fresh_gradients)
        product = found.inverse_columns
        product[cols, np.arange(len(cols))] -= 1.0  # R M - I
        inverse = _largest(product)
        # |rho - the rho a fresh solve would report|: nonzero only while no margin coefficient
        # is free (a fresh solve then reports the midpoint of rho's optimal interval, and a rho
        # pinned anywhere else by a residue moves every f although the KKT conditions of the
        # maintained partition hold)
        rho = found.rho_offset
        repaired = repair and not (drift <= AUDIT_GRAD_TOL and inverse <= AUDIT_INVERSE_TOL
                                   and rho <= AUDIT_GRAD_TOL)
        if repaired:
            solver.audit()  # refactorises: the repair the solver's periodic audit makes
        return {"gradients_checked": len(found.fresh_gradients), "grad_drift": drift,
                "inverse_columns_checked": len(cols), "inverse_residual": inverse,
                "rho_offset": rho, "repaired": repaired}

    def _next_ids(self, ids, k):
        """The next k solver ids in id order from the cursor (which wraps), advancing it."""
        n = ids.shape[0]
        if n == 0:
            return ids
        start = int(np.searchsorted(ids, self.next_id))
        chosen = ids[(start + np.arange(k)) % n]
        self.next_id = int(ids[(start + k) % n]) if k < n else int(chosen[0])
        return chosen

    def _next_columns(self, m, k):
        """The next k columns of the (m + 1)-square bordered system, advancing the cursor."""
        if m == 0:
            return np.zeros(0, dtype=np.int64)
        size = m + 1
        cols = (self.next_column + np.arange(k)) % size
        self.next_column = int((self.next_column + k) % size)
        return cols
