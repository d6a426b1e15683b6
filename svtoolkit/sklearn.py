r"""A scikit-learn estimator on the exact solver: kernel one-class SVM with exact deletion.

:class:`IncrementalOneClassSVM` is scikit-learn's RBF :class:`~sklearn.svm.OneClassSVM`
maintained by :class:`~svtoolkit.IncrementalSVDD`: ``fit`` solves, ``partial_fit`` admits
samples by exact increments, ``forget`` deletes fitted samples by exact decrements (the result
is the optimum of the retained samples under the same C, what a refit gives). Needs
scikit-learn >= 1.6 (``validate_data`` and ``__sklearn_tags__``).

The mapping to scikit-learn's parametrisation (derivation in ``docs/sklearn.md``), with
``C = 1 / (nu n0)`` fixed at fit time and ``n`` samples currently held:

* kernel: ``exp(-gamma |x - y|^2) = exp(-|x - y|^2 / sigma^2)``, so ``sigma = 1 / sqrt(gamma)``;
* dual: libsvm's coefficients are ``alpha_sk = a / C`` (sum ``1 / C = nu n0``, box [0, 1]),
  the solution of ``OneClassSVM(nu = 1 / (C n))`` on the samples held;
* decision: ``decision_function = f / (2 C)`` with the solver's
  ``f(x) = 2 sum_i a_i k(x, x_i) - 1 + rho``; ``offset_ = (1 - rho) / (2 C)``.
"""

from __future__ import annotations

import contextlib
import math
from numbers import Integral, Real

import numpy as np

from ._optional import require

require("sklearn", feature="svtoolkit.sklearn")

from sklearn.base import BaseEstimator, OutlierMixin, _fit_context  # noqa: E402
from sklearn.utils._param_validation import Interval, StrOptions  # noqa: E402
from sklearn.utils.validation import check_is_fitted, validate_data  # noqa: E402

from ._validation import check_sigma  # noqa: E402
from .exact import IncrementalSVDD, SolverFailure  # noqa: E402

__all__ = ["IncrementalOneClassSVM"]


class IncrementalOneClassSVM(OutlierMixin, BaseEstimator):
    r"""RBF one-class SVM with exact incremental fitting and exact deletion of samples.

    Solves scikit-learn's one-class SVM dual (Schölkopf et al., "Estimating the support of a
    high-dimensional distribution", Neural Computation 13(7), 2001) with the exact fp64
    incremental/decremental solver :class:`~svtoolkit.IncrementalSVDD` (Cauwenberghs and
    Poggio, "Incremental and decremental support vector machine learning", NIPS 2000). With
    the RBF kernel this dual is the SVDD dual (Tax and Duin, "Support vector data
    description", Machine Learning 54, 2004) up to the scaling ``alpha_sk = a / C``.

    Parameters
    ----------
    nu : float in (0, 1], default 0.5
        Upper bound on the fraction of training errors and lower bound on the fraction of
        support vectors, at the reference size ``n0``. Sets ``C = 1 / (nu * n0)``.
    gamma : {"scale", "auto"} or float > 0, default "scale"
        RBF coefficient, ``k(x, y) = exp(-gamma |x - y|^2)``. ``"scale"`` is
        ``1 / (n_features * X.var())`` (1.0 when ``X.var()`` is 0), ``"auto"`` is
        ``1 / n_features``, as in :class:`sklearn.svm.OneClassSVM`. Resolved from the data
        passed to :meth:`fit` (or the first :meth:`partial_fit`) and then fixed.
    n0 : int >= 1 or None, default None
        Reference size for ``C = 1 / (nu * n0)``; None takes the number of samples at
        :meth:`fit`. C stays fixed through :meth:`partial_fit` and :meth:`forget`, so the model
        held is always ``OneClassSVM(nu=1 / (C * n))`` on the ``n`` samples held. Fix ``n0``
        to compare or chain fits of different sizes under one C, or to stream samples in
        chunks smaller than ``nu * n0`` (see Notes: warm-up).

    Attributes
    ----------
    solver_ : IncrementalSVDD
        The exact solver (read it, do not modify it: the attributes below are synchronised
        by this estimator's methods only). Its ids are the sample ids.
    gamma_ : float
        The resolved RBF coefficient.
    C_ : float
        The box constraint ``1 / (nu * n0_)``.
    n0_ : int
        The resolved reference size.
    sample_ids_ : ndarray of shape (n_samples_held,), int64
        Ids of the samples held, ascending. A sample's id is its position in the sequence of
        all samples passed to :meth:`fit` and the :meth:`partial_fit` calls after it
        (``fit`` restarts the numbering at 0). :meth:`forget` takes these ids.
    n_samples_seen_ : int
        Samples passed since the last :meth:`fit`, forgotten ones included (the id the next
        sample will get).
    support_ : ndarray of shape (n_SV,), int32
        Indices of the support vectors (coefficient > 0), ascending, into the rows the
        estimator holds now, in fit/partial_fit order: right after :meth:`fit` they index
        the fit data, as :class:`~sklearn.svm.OneClassSVM`'s do. After :meth:`forget` they
        index the remaining rows (the held rows with the forgotten ones left out), so that
        they equal ``OneClassSVM.support_`` of a fit on those rows; the samples' ids are
        ``sample_ids_[support_]``.
    n_support_ : ndarray of shape (1,), int32
        Number of support vectors, as :class:`~sklearn.svm.OneClassSVM` (one class).
    support_vectors_ : ndarray of shape (n_SV, n_features)
        The support vectors (the held rows ``support_``).
    dual_coef_ : ndarray of shape (1, n_SV)
        Coefficients of the support vectors in libsvm's scaling, ``a / C`` in [0, 1],
        summing to ``nu * n0``: those of ``OneClassSVM(nu = 1 / (C n))`` on the ``n`` rows
        held (the solver's own ``a = C * dual_coef_`` sum to 1).
    offset_ : float
        ``decision_function = score_samples - offset_``; equals ``(1 - rho) / (2 C)``. NaN
        during warm-up.
    intercept_ : ndarray of shape (1,)
        ``-offset_``.
    n_features_in_ : int
        Number of features seen at fit.
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Feature names, when fit on a DataFrame whose column names are all strings.

    See Also
    --------
    sklearn.svm.OneClassSVM : the batch estimator this one reproduces.
    sklearn.linear_model.SGDOneClassSVM : linear, approximate, with ``partial_fit``.
    svtoolkit.IncrementalSVDD : the solver underneath.

    Notes
    -----
    **Warm-up.** ``n`` samples can satisfy ``sum(a) = 1, a <= C`` only once ``n C >= 1``,
    i.e. ``n >= nu * n0``. With fewer samples held (a fit or first chunks smaller than that,
    or after :meth:`forget`) the estimator is fitted but in warm-up: the solver holds the
    samples (each at its exact increment, the missing mass on a virtual anchor), no one-class
    SVM solution exists yet, and :meth:`decision_function`, :meth:`score_samples` and
    :meth:`predict` raise ``ValueError`` saying how many samples are missing. The samples
    that complete ``nu * n0`` end it; the model is then what one :meth:`fit` of all the
    samples gives. ``solver_.certified`` is False during warm-up.

    ``predict`` is +1 where ``decision_function >= 0`` (scikit-learn's outlier-detector
    convention); ``OneClassSVM.predict`` returns -1 at exactly 0 (libsvm tests ``> 0``).

    Examples
    --------
    >>> import numpy as np
    >>> from svtoolkit.sklearn import IncrementalOneClassSVM
    >>> X = np.random.default_rng(0).standard_normal((60, 2))
    >>> est = IncrementalOneClassSVM(nu=0.2, gamma=0.5).fit(X[:40])
    >>> est = est.partial_fit(X[40:])  # ids 40..59
    >>> est = est.forget([3, 41])      # exact deletion of two fitted samples
    >>> est.sample_ids_.shape, est.predict(X[:3]).tolist()
    ((58,), [-1, 1, 1])
    """

    _parameter_constraints: dict = {
        "nu": [Interval(Real, 0.0, 1.0, closed="right")],
        "gamma": [StrOptions({"scale", "auto"}), Interval(Real, 0.0, None, closed="neither")],
        "n0": [Interval(Integral, 1, None, closed="left"), None],
    }

    def __init__(self, nu=0.5, gamma="scale", n0=None):
        self.nu = nu
        self.gamma = gamma
        self.n0 = n0

    # ------------------------------------------------------------------ fitting
    @_fit_context(prefer_skip_nested_validation=True)
    def fit(self, X, y=None):
        """Solve the one-class SVM on ``X`` (a fresh model; sample ids restart at 0).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : ignored

        Returns
        -------
        self

        Raises
        ------
        ValueError
            Bad input (NaN, inf, wrong shape). The estimator is unchanged. Fewer than
            ``nu * n0`` samples are accepted: the estimator is then in warm-up (see Notes).
        SolverFailure
            An exact walk failed (numerically degenerate data); the estimator is unchanged.
        """
        with self._input_attributes_kept_on_failure():
            X = validate_data(self, X, dtype=np.float64, reset=True)
            self._start(X)
        return self

    @_fit_context(prefer_skip_nested_validation=True)
    def partial_fit(self, X, y=None):
        """Admit the rows of ``X`` by exact increments (the first call on an unfitted
        estimator is :meth:`fit`). Their ids continue from :attr:`n_samples_seen_`.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
        y : ignored

        Returns
        -------
        self

        Raises
        ------
        ValueError
            Bad input, or a number of features other than at fit. Nothing is admitted.
        SolverFailure
            An exact walk failed and so did its fallback; the model is the one held before
            the call and none of ``X`` was admitted.
        """
        if not self.__sklearn_is_fitted__():
            return self.fit(X)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        try:
            self.solver_.extend(X)
        finally:
            self._sync()  # after a SolverFailure the solver holds the state before the call
        self.n_samples_seen_ += len(X)
        return self

    def forget(self, ids):
        """Delete fitted samples exactly (exact unlearning), by decrements or, for a large batch
        on a margin-heavy model, a fresh solve of the rest (:meth:`IncrementalSVDD.remove_many`).

        Afterwards the model is the optimum of the retained samples under the same C: what
        ``fit`` on them with ``n0=n0_`` and ``gamma=gamma_`` gives.

        Parameters
        ----------
        ids : int or array-like of int
            Sample ids (see :attr:`sample_ids_`), distinct. An empty list changes nothing.

        Returns
        -------
        self

        Raises
        ------
        TypeError
            Ids that are not integers.
        ValueError
            Repeated ids.
        KeyError
            An id that was never fitted or was already forgotten.

        A deletion that leaves fewer than ``nu * n0_`` samples is not refused: the estimator
        returns to warm-up (see Notes) until :meth:`partial_fit` brings the samples back to
        ``nu * n0_``. Every check runs before anything is deleted; a refused call changes
        nothing. If an exact walk fails part-way, the model is restored to its state before
        the call and :class:`~svtoolkit.SolverFailure` is raised.
        """
        check_is_fitted(self)
        wanted = self._checked_ids(ids)
        if len(wanted) == 0:
            return self
        backup = self.solver_.copy()
        try:
            self.solver_.remove_many(wanted)  # a fresh solve of the rest where that is cheaper
        except SolverFailure:
            self.solver_ = backup
            raise
        finally:
            self._sync()
        return self

    def _checked_ids(self, ids):
        """``ids`` as a 1-D int64 array of distinct held ids, or the error naming the problem."""
        arr = np.asarray(ids)
        if arr.ndim > 1:
            raise ValueError(f"ids must be an int or a 1-D array-like; got shape {arr.shape}")
        arr = arr.reshape(-1)
        if arr.size == 0:
            return arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise TypeError(f"ids must be integers; got dtype {arr.dtype}")
        arr = arr.astype(np.int64)
        unique, counts = np.unique(arr, return_counts=True)
        if (counts > 1).any():
            raise ValueError(f"ids must be distinct; repeated: {unique[counts > 1].tolist()}")
        held = np.isin(arr, self.sample_ids_)
        if not held.all():
            bad = int(arr[~held][0])
            if 0 <= bad < self.n_samples_seen_:
                raise KeyError(f"sample id {bad} was already forgotten; nothing was forgotten")
            raise KeyError(f"unknown sample id {bad} (ids are 0..{self.n_samples_seen_ - 1} "
                           "in fit/partial_fit order); nothing was forgotten")
        return arr

    def __sklearn_is_fitted__(self):
        return hasattr(self, "solver_")

    @contextlib.contextmanager
    def _input_attributes_kept_on_failure(self):
        """Undo ``validate_data``'s reset of ``n_features_in_`` / ``feature_names_in_`` when the
        fit it belongs to fails, so that a refused fit leaves the estimator as it was."""
        names = ("n_features_in_", "feature_names_in_")
        saved = {name: vars(self)[name] for name in names if name in vars(self)}
        try:
            yield
        except BaseException:
            for name in names:
                vars(self).pop(name, None)
            vars(self).update(saved)
            raise

    def _start(self, X):
        """A fresh solver on validated ``X``; the estimator's state is replaced only on success."""
        gamma = self._resolve_gamma(X)
        n0 = X.shape[0] if self.n0 is None else int(self.n0)
        solver = IncrementalSVDD.from_nu(self.nu, n0, sigma=1.0 / math.sqrt(gamma))
        solver.extend(X)
        self.solver_, self.gamma_, self.n0_, self.C_ = solver, gamma, n0, solver.C
        self.n_samples_seen_ = X.shape[0]
        self._sync()

    def _resolve_gamma(self, X):
        """The RBF coefficient from the ``gamma`` parameter and the fit data (as scikit-learn)."""
        if self.gamma == "scale":
            variance = X.var()
            gamma = 1.0 / (X.shape[1] * variance) if variance != 0 else 1.0
        elif self.gamma == "auto":
            gamma = 1.0 / X.shape[1]
        else:
            gamma = float(self.gamma)
        sigma = 1.0 / math.sqrt(gamma) if math.isfinite(gamma) and gamma > 0 else 0.0
        try:
            check_sigma(sigma)  # the solver's own check of the width it will be given
        except ValueError:
            raise ValueError(f"gamma={self.gamma!r} resolves to {gamma!r}, outside the range "
                             "the RBF kernel supports (1/gamma and gamma finite normal floats)"
                             ) from None
        return gamma

    def _sync(self):
        """Refresh the fitted attributes from the solver."""
        solver = self.solver_
        C = solver.C
        alpha = solver.alpha
        support = np.flatnonzero(alpha > 0.0)  # positions among the held rows, ascending
        self.sample_ids_ = solver.ids
        self.support_ = support.astype(np.int32)
        self.n_support_ = np.array([support.size], dtype=np.int32)
        self.support_vectors_ = solver.keys[support]
        self.dual_coef_ = (alpha[support] / C)[None, :]
        # in warm-up rho belongs to the anchored problem: no offset exists yet
        self.offset_ = (1.0 - solver.rho) / (2.0 * C) if solver.certified else math.nan
        self.intercept_ = np.array([-self.offset_])

    # ------------------------------------------------------------------ evaluation
    def decision_function(self, X):
        """Signed distance to the separating surface: > 0 inside, < 0 outside.

        Equal to :meth:`sklearn.svm.OneClassSVM.decision_function` of the same problem:
        ``sum_i alpha_sk_i k(x, x_i) - offset_`` = ``f(x) / (2 C)``. Computed as
        ``score_samples(X) - offset_``, so that the two agree to the last bit.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        ndarray of shape (n_samples,)
        """
        return self.score_samples(X) - self.offset_

    def score_samples(self, X):
        """Raw scores ``sum_i alpha_sk_i k(x, x_i)`` = ``decision_function + offset_``.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        ndarray of shape (n_samples,)
        """
        check_is_fitted(self)
        X = validate_data(self, X, dtype=np.float64, reset=False)
        self._check_certified()
        f = self.solver_.decision_function(X)  # 2 sum_i a_i k(x, x_i) - 1 + rho
        return (f + (1.0 - self.solver_.rho)) / (2.0 * self.C_)

    def _check_certified(self):
        """Raise the warm-up error when fewer than nu * n0 samples are held."""
        if self.solver_.certified:
            return
        held = len(self.solver_)
        raise ValueError(
            f"the model holds {held} samples, but C = 1/(nu*n0) = {self.C_:.6g} needs at least "
            f"nu*n0 = {1.0 / self.C_:.6g} of them (n * C >= 1) before a one-class SVM exists "
            "(warm-up); add samples with partial_fit")

    def predict(self, X):
        """+1 for inliers (``decision_function >= 0``), -1 for outliers.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)

        Returns
        -------
        ndarray of shape (n_samples,), int
        """
        return np.where(self.decision_function(X) >= 0.0, 1, -1).astype(np.intp)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self):
        # The solver travels as its public state dict: validated on load, and copied into
        # fresh writable buffers (joblib may hand back read-only memory maps).
        state = dict(super().__getstate__())
        solver = state.pop("solver_", None)
        if solver is not None:
            state["_solver_state"] = solver.state_dict()  # every setting that steers it
        return state

    def __setstate__(self, state):
        state = dict(state)
        solver_state = state.pop("_solver_state", None)
        max_events = state.pop("_solver_max_events", None)  # pickles of format-2 states
        super().__setstate__(state)
        if solver_state is not None:
            self.solver_ = IncrementalSVDD.from_state_dict(solver_state)
            if max_events is not None:
                self.solver_.max_events = max_events
