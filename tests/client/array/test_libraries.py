"""Unmodified libraries on the namespace: scikit-learn through ``array_api_dispatch`` (LDA, PCA and Ridge, then
more estimators), SciPy functions that dispatch on their argument, and einops through ``einops.array_api``,
in-process (PoCL; CuPy with -m cuda) and through a real broker (the same-host ring with ``async_commands``), each
result compared with the same library on NumPy.

The namespace ``array_api_strict`` (the standard's reference) runs the same tests: a failure there means the
test asks for something the standard does not give, not that ours is wrong.

The SDK guide's scikit-learn example (docs/sdk/arrays.md) runs with the docs' examples (tests/docs).
"""

from __future__ import annotations

import os

# scipy reads SCIPY_ARRAY_API once, when it is first imported, and scikit-learn refuses array_api_dispatch
# without it; tests/conftest.py sets it before any test module imports either (setting it here alone would be
# too late whenever another module imported scipy first). Checked here so the cause is named if that changes.
os.environ.setdefault("SCIPY_ARRAY_API", "1")

from collections.abc import Callable, Iterator
from typing import Any

import array_api_strict
import einops
import einops.array_api
import numpy as np
import pytest
import scipy.fft
import scipy.special
import scipy.stats
import sklearn
from sklearn.decomposition import PCA
from sklearn.discriminant_analysis import LinearDiscriminantAnalysis
from sklearn.linear_model import LogisticRegression, Ridge, RidgeCV
from sklearn.metrics import r2_score
from sklearn.metrics.pairwise import rbf_kernel
from sklearn.naive_bayes import GaussianNB
from sklearn.preprocessing import MinMaxScaler, StandardScaler

import gpubroker.client.array
from gpubroker.broker.backends import open_backend
from gpubroker.client import GpuCompute, RemoteGpu, ResourceExhausted

# How each namespace is reached: ours in-process and through a broker, and the standard's reference.
WHERE = ["in-process", "broker", "array_api_strict"]
OpenGpu = Callable[..., RemoteGpu]  # tests/conftest.py's open_gpu (this folder is not a package to import it from)


@pytest.fixture(scope="module", params=WHERE)
def xp(request: pytest.FixtureRequest, backend: str, open_gpu: OpenGpu) -> Iterator[Any]:
    """An Array API namespace: ours on ``backend`` (in this process, or a session on the shared broker over the
    same-host ring with async_commands), or array_api_strict."""
    if request.param == "array_api_strict":
        if backend != "opencl":
            pytest.skip("the reference runs once, with the opencl parameters")
        yield array_api_strict
        return
    gpu: GpuCompute = (open_backend(backend) if request.param == "in-process"
                       else open_gpu("alice", "ring", async_commands=True))
    try:
        yield gpubroker.client.array.namespace(gpu)
    finally:
        gpu.close()


def _host(x: Any) -> np.ndarray[Any, Any]:
    """A namespace's array (or a NumPy one) as a NumPy array on the host."""
    return np.asarray(x)


def test_scipy_array_api_is_on_before_sklearn_uses_it() -> None:
    from scipy._lib._array_api import SCIPY_ARRAY_API

    assert SCIPY_ARRAY_API, "scipy was imported before SCIPY_ARRAY_API=1 was set (see tests/conftest.py)"


# -- scikit-learn -------------------------------------------------------------------------------------------
def _blobs(n: int = 240, features: int = 6, classes: int = 3) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Gaussian classes with distinct means (float32 features, int64 labels)."""
    rng = np.random.default_rng(14)
    centers = rng.normal(0, 3, (classes, features))
    labels = rng.integers(0, classes, n)
    X = centers[labels] + rng.normal(0, 1, (n, features))
    return X.astype(np.float32), labels.astype(np.int64)


def _low_rank(n: int = 300, features: int = 12) -> np.ndarray[Any, Any]:
    """Data whose variance falls off across directions, so principal components are well separated."""
    rng = np.random.default_rng(7)
    scales = np.geomspace(10.0, 0.1, features)
    basis, _ = np.linalg.qr(rng.normal(size=(features, features)))
    return ((rng.normal(size=(n, features)) * scales) @ basis.T + 5.0).astype(np.float32)


def _close(ours: Any, reference: np.ndarray[Any, Any], rtol: float = 2e-3) -> None:
    """float32 work on another device: agreement relative to the reference's magnitude."""
    got = _host(ours)
    assert got.shape == reference.shape
    np.testing.assert_allclose(got, reference, rtol=rtol, atol=rtol * float(np.max(np.abs(reference))))


def _same_up_to_column_sign(ours: Any, reference: np.ndarray[Any, Any]) -> None:
    """An SVD's vectors are defined up to sign (LDA's scalings are not sign-normalized): align, then compare."""
    got = _host(ours)
    signs = np.sign(np.sum(got * reference, axis=0))
    _close(got * signs, reference)


def test_lda_fit_predict_transform_match_numpy(xp: Any) -> None:
    X, y = _blobs()
    ref = LinearDiscriminantAnalysis().fit(X, y)
    with sklearn.config_context(array_api_dispatch=True):
        lda = LinearDiscriminantAnalysis().fit(xp.asarray(X), xp.asarray(y))
        predicted = lda.predict(xp.asarray(X))
        transformed = lda.transform(xp.asarray(X))
        decision = lda.decision_function(xp.asarray(X))
    assert predicted.__array_namespace__() is xp.asarray(X).__array_namespace__()  # stayed on the device
    np.testing.assert_array_equal(_host(predicted), ref.predict(X))
    np.testing.assert_array_equal(_host(lda.classes_), ref.classes_)
    _close(lda.means_, ref.means_)
    _close(decision, ref.decision_function(X))
    _same_up_to_column_sign(transformed, ref.transform(X))


@pytest.mark.parametrize("svd_solver", ["full", "covariance_eigh", "randomized"])
def test_pca_fit_transform_matches_numpy(xp: Any, svd_solver: str) -> None:
    # The solvers scikit-learn's array API path has ("arpack" is NumPy-only). svd_flip makes the components'
    # signs deterministic, so they compare directly; "randomized" draws its test matrix on the host from
    # random_state, the same for both; its power iterations normalize by QR (the standard has no LU).
    X = _low_rank()
    options = {"power_iteration_normalizer": "QR"} if svd_solver == "randomized" else {}
    ref = PCA(n_components=4, svd_solver=svd_solver, random_state=0, **options)
    expected = ref.fit_transform(X)
    with sklearn.config_context(array_api_dispatch=True):
        pca = PCA(n_components=4, svd_solver=svd_solver, random_state=0, **options)
        got = pca.fit_transform(xp.asarray(X))
        back = pca.inverse_transform(got)
    _close(got, expected)
    _close(pca.components_, ref.components_)
    _close(pca.explained_variance_, ref.explained_variance_)
    _close(pca.mean_, ref.mean_)
    _close(back, ref.inverse_transform(expected))


def test_pca_fractional_n_components_picks_as_numpy_does(xp: Any) -> None:
    X = _low_rank()
    ref = PCA(n_components=0.95, svd_solver="full").fit(X)
    with sklearn.config_context(array_api_dispatch=True):
        pca = PCA(n_components=0.95, svd_solver="full").fit(xp.asarray(X))
    assert int(pca.n_components_) == int(ref.n_components_)  # a 0-d array of xp under dispatch
    _close(pca.explained_variance_ratio_, ref.explained_variance_ratio_)


@pytest.mark.filterwarnings("ignore:Using Array API dispatch to namespace:UserWarning")  # auto picks svd
@pytest.mark.parametrize("multi_target", [False, True], ids=["one-target", "two-targets"])
def test_ridge_fit_predict_match_numpy(xp: Any, multi_target: bool) -> None:
    # The array API path of Ridge solves with "svd" (the only solver it takes besides "auto", which picks it).
    rng = np.random.default_rng(3)
    X = rng.normal(size=(200, 8)).astype(np.float32)
    coef = rng.normal(size=(8, 2 if multi_target else 1))
    y = (X @ coef + 0.5 + rng.normal(0, 0.1, (200, coef.shape[1]))).astype(np.float32)
    if not multi_target:
        y = y[:, 0]
    for solver in ("svd", "auto"):
        ref = Ridge(alpha=2.0, solver=solver).fit(X, y)
        with sklearn.config_context(array_api_dispatch=True):
            ridge = Ridge(alpha=2.0, solver=solver).fit(xp.asarray(X), xp.asarray(y))
            predicted = ridge.predict(xp.asarray(X))
        _close(ridge.coef_, ref.coef_)
        _close(ridge.intercept_, np.asarray(ref.intercept_))
        _close(predicted, ref.predict(X))


def _not_through_the_broker(request: pytest.FixtureRequest) -> None:
    if "broker" in request.node.callspec.id:
        pytest.skip("in-process only: LDA, PCA and Ridge cover the broker (this keeps the file quick)")


# Other estimators and functions with array API support in scikit-learn 1.9, each reaching parts of the namespace
# the three above do not (constants such as xp.inf and xp.pi, hashing the namespace, logsumexp, pairwise
# kernels): name -> what it computes from (X, class labels, regression targets).
MORE: dict[str, Callable[[Any, Any, Any], Any]] = {
    "StandardScaler": lambda X, y, t: StandardScaler().fit_transform(X),
    "MinMaxScaler": lambda X, y, t: MinMaxScaler().fit_transform(X),
    "GaussianNB": lambda X, y, t: GaussianNB().fit(X, y).predict_proba(X),
    "LogisticRegression": lambda X, y, t: LogisticRegression().fit(X, y).predict_proba(X),
    "RidgeCV": lambda X, y, t: RidgeCV(alphas=(0.1, 1.0, 10.0)).fit(X, t).predict(X),
    "rbf_kernel": lambda X, y, t: rbf_kernel(X),
    "r2_score": lambda X, y, t: r2_score(t, 0.9 * t),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # RidgeCV's note that dispatch solves with "svd"
@pytest.mark.parametrize("name", MORE)
def test_more_estimators_match_numpy(request: pytest.FixtureRequest, xp: Any, name: str) -> None:
    _not_through_the_broker(request)
    X, y = _blobs()
    t = (X @ np.linspace(-1, 1, X.shape[1]) + 0.5).astype(np.float32)
    expected = np.asarray(MORE[name](X, y, t), dtype=np.float64)
    with sklearn.config_context(array_api_dispatch=True):
        got = MORE[name](xp.asarray(X), xp.asarray(y), xp.asarray(t))
    _close(np.asarray(_host(got), dtype=np.float64), expected)


# -- SciPy --------------------------------------------------------------------------------------------------
# SciPy functions that dispatch to the namespace of their argument (with SCIPY_ARRAY_API=1): special functions
# with reductions, statistics, transforms.
SCIPY: dict[str, Callable[[Any], Any]] = {
    "special.logsumexp": lambda a: scipy.special.logsumexp(a, axis=1),
    "special.softmax": lambda a: scipy.special.softmax(a, axis=1),
    "special.expit": lambda a: scipy.special.expit(a),
    "stats.zscore": lambda a: scipy.stats.zscore(a, axis=0),
    "stats.skew": lambda a: scipy.stats.skew(a, axis=0),
    "fft.rfft": lambda a: scipy.fft.rfft(a, axis=1),
    "fft.dct": lambda a: scipy.fft.dct(a, axis=1),
}


@pytest.mark.parametrize("name", SCIPY)
def test_scipy_functions_match_numpy(request: pytest.FixtureRequest, xp: Any, name: str) -> None:
    _not_through_the_broker(request)
    x = np.random.default_rng(9).normal(size=(6, 8)).astype(np.float32)
    got = SCIPY[name](xp.asarray(x))
    assert got.__array_namespace__() is xp.asarray(x).__array_namespace__()  # computed on the device
    _close(got, SCIPY[name](x), rtol=1e-4)


# -- einops -------------------------------------------------------------------------------------------------
def _needs_list_shapes(xp: Any) -> None:
    if xp is array_api_strict:
        pytest.skip("einops.array_api passes shapes as lists, which array_api_strict refuses")


REARRANGE = [
    ("b c h w -> b (h w c)", {}),
    ("b c h w -> (b h) w c", {}),
    ("b c (h h2) w -> b (c h2) h w", {"h2": 2}),
    ("b c h w -> w h c b", {}),
]


@pytest.mark.parametrize(("pattern", "lengths"), REARRANGE, ids=[p for p, _ in REARRANGE])
def test_einops_rearrange_matches_numpy(xp: Any, pattern: str, lengths: dict[str, int]) -> None:
    _needs_list_shapes(xp)
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float32).reshape(2, 3, 4, 5)
    got = einops.array_api.rearrange(xp.asarray(x), pattern, **lengths)
    np.testing.assert_array_equal(_host(got), einops.rearrange(x, pattern, **lengths))


REDUCE = [
    ("b c h w -> b c", "mean", {}),
    ("b c (h h2) (w w2) -> b c h w", "max", {"h2": 2, "w2": 2}),
    ("b c h w -> c", "sum", {}),
    ("b c h w -> b 1 h w", "min", {}),
    ("b c h w -> b h w", "prod", {}),
]


@pytest.mark.parametrize(("pattern", "reduction", "lengths"), REDUCE, ids=[f"{r}:{p}" for p, r, _ in REDUCE])
def test_einops_reduce_matches_numpy(xp: Any, pattern: str, reduction: str, lengths: dict[str, int]) -> None:
    _needs_list_shapes(xp)
    x = np.random.default_rng(5).uniform(0.5, 1.5, (2, 3, 4, 6)).astype(np.float32)
    got = einops.array_api.reduce(xp.asarray(x), pattern, reduction, **lengths)
    np.testing.assert_allclose(_host(got), einops.reduce(x, pattern, reduction, **lengths), rtol=1e-5)


def test_einops_repeat_and_pack_match_numpy(xp: Any) -> None:
    _needs_list_shapes(xp)
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    got = einops.array_api.repeat(xp.asarray(x), "h w -> h w c", c=3)
    np.testing.assert_array_equal(_host(got), einops.repeat(x, "h w -> h w c", c=3))
    packed, shapes = einops.array_api.pack([xp.asarray(x), xp.asarray(x[:, :1])], "h *")
    np.testing.assert_array_equal(_host(packed), np.concatenate([x, x[:, :1]], axis=1))
    assert [tuple(s) for s in shapes] == [(3,), (1,)]


# -- the section's guarantees, as it states them ------------------------------------------------------------
def test_an_array_past_the_quota_is_resource_exhausted_naming_the_size(open_gpu: OpenGpu) -> None:
    # carol's quota is 64 MiB; with async_commands the allocation's error comes at the next wait, naming the size.
    gpu = open_gpu("carol", "ring", async_commands=True)
    try:
        xp = gpubroker.client.array.namespace(gpu)
        too_big = xp.zeros((32 << 20,), dtype=xp.float32)  # 128 MiB
        with pytest.raises(ResourceExhausted, match=str(128 << 20)):
            float(xp.sum(too_big))
        del too_big
        assert float(xp.sum(xp.ones((1000,), dtype=xp.float32))) == 1000.0  # the session goes on
    finally:
        gpu.close()


def test_wrong_dtypes_and_shapes_are_python_errors_on_the_client(xp: Any) -> None:
    floats, ints = xp.asarray(np.ones((2, 3), np.float32)), xp.asarray(np.ones((2, 3), np.int32))
    with pytest.raises(TypeError):
        xp.bitwise_and(floats, floats)
    with pytest.raises(ValueError):
        floats + xp.asarray(np.ones((4,), np.float32))
    with pytest.raises(IndexError):
        ints[5, 0]
