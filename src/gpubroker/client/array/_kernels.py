"""Kernels generated from one operation table into CUDA C and OpenCL C, compiled once per signature and cached.

Every method queues device work on the context's GpuCompute and returns at once; nothing here waits for the
device (compiling a new signature is the one call that may take a round trip).

How a launch is planned: the operands' views are reduced to the fewest dimensions that address them the same way
(size-1 dimensions dropped, adjacent dimensions merged where every operand's strides allow). One dimension whose
operands are each contiguous or a single repeated element takes the *contiguous* kernel (index ``i`` directly);
anything else takes the *strided* kernel of that many dimensions, which reads the shape and every operand's
strides from a small int64 "meta" array on the device. A plan (kernel, launch size, meta buffer) is cached per
(operation, dtypes, shape, strides), so a loop of same-shaped operations generates, compiles and uploads nothing:
a launch is a dictionary lookup and ``execute_kernel``.
"""

from __future__ import annotations

import itertools
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np

from gpubroker.client import GpuBrokerError, Kernel

if TYPE_CHECKING:
    from gpubroker.client.array._context import Context, Storage, View

__all__ = ["ELEMENTWISE_OPS", "REDUCTIONS", "Kernels"]

_PLANS_MAX: Final = 256  # cached launch plans (each may hold a meta buffer on the device)
_SMALL_INDEX: Final = 2**31  # below this many elements the strided kernels decompose indices in 32 bits

# -- C types ---------------------------------------------------------------------------------------------------
_CTYPE: Final = {"b": "U8", "i1": "I8", "i2": "I16", "i4": "I32", "i8": "I64", "u1": "U8", "u2": "U16",
                 "u4": "U32", "u8": "U64", "f4": "F32", "f8": "F64", "c8": "C64", "c16": "C128"}
_UNSIGNED: Final = {"I8": "U8", "I16": "U16", "I32": "U32", "I64": "U64", "U8": "U8", "U16": "U16", "U32": "U32",
                    "U64": "U64"}
_REAL_OF: Final = {"C64": "F32", "C128": "F64"}


def ctype(dtype: np.dtype[Any]) -> str:
    """The prelude's macro for a dtype's C type (bool is stored as an unsigned char holding 0 or 1)."""
    return _CTYPE["b" if dtype.kind == "b" else f"{dtype.kind}{dtype.itemsize}"]


_PRELUDE: Final = r"""
#ifdef __OPENCL_VERSION__
#define KERNEL __kernel
#define GLOBAL __global
#define SHARED __local
#define FN static inline
#define GID ((long)get_global_id(0))
#define GSIZE ((long)get_global_size(0))
#define LID ((int)get_local_id(0))
#define GROUP ((long)get_group_id(0))
#define NGROUPS ((long)get_num_groups(0))
#define SYNC() barrier(CLK_LOCAL_MEM_FENCE)
#define I8 char
#define U8 uchar
#define I16 short
#define U16 ushort
#define I32 int
#define U32 uint
#define I64 long
#define U64 ulong
#define GB_INF ((float)INFINITY)
#define GB_NAN ((float)NAN)
#else
#define KERNEL extern "C" __global__
#define GLOBAL
#define SHARED __shared__
#define FN static __device__ __forceinline__
#define GID ((long long)blockIdx.x * blockDim.x + threadIdx.x)
#define GSIZE ((long long)gridDim.x * blockDim.x)
#define LID ((int)threadIdx.x)
#define GROUP ((long long)blockIdx.x)
#define NGROUPS ((long long)gridDim.x)
#define SYNC() __syncthreads()
#define I8 signed char
#define U8 unsigned char
#define I16 short
#define U16 unsigned short
#define I32 int
#define U32 unsigned int
#define I64 long long
#define U64 unsigned long long
#define GB_INF __int_as_float(0x7f800000)
#define GB_NAN __int_as_float(0x7fffffff)
#endif
#define F32 float
#define F64 double
#define GB_PI_2 1.570796326794896619231321691639751442
#define GB_PI_4 0.785398163397448309615660845819875721
#define GB_LN2 0.693147180559945309417232121458176568
"""
_FP64: Final = "#ifdef __OPENCL_VERSION__\n#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n#endif\n"

# Helpers of one real type R: Python's floor division and remainder (NumPy's divmod), logaddexp, clip.
_REAL_HELPERS: Final = r"""
FN R R_floordiv(R a, R b) {
  R mod = fmod(a, b);
  if (b == (R)0 || isinf(a) || isinf(b)) return a / b;  /* the standard's infinities: +-inf, +-0 or NaN */
  R div = (a - mod) / b;
  if (mod != (R)0) { if ((b < (R)0) != (mod < (R)0)) div -= (R)1; }
  R fl;
  if (div != (R)0) { fl = floor(div); if (div - fl > (R)0.5) fl += (R)1; }
  else { fl = copysign((R)0, a / b); }
  return fl;
}
FN R R_rem(R a, R b) {
  R mod = fmod(a, b);
  if (b == (R)0) return mod;
  if (mod != (R)0) { if ((b < (R)0) != (mod < (R)0)) mod += b; }
  else { mod = copysign((R)0, b); }
  return mod;
}
FN R R_logaddexp(R a, R b) {
  if (a == b) return a + (R)0.693147180559945309417232121458176568;
  R d = a - b;
  return d > (R)0 ? a + log1p(exp(-d)) : (d <= (R)0 ? b + log1p(exp(d)) : d);
}
FN R R_clip(R x, R lo, R hi) {
  if (isnan(lo)) return lo;
  if (isnan(hi)) return hi;
  R r = x < lo ? lo : x;
  return r > hi ? hi : r;
}
"""
# Helpers of one integer type T (U: its unsigned type): division by zero gives 0 and never traps (nor does
# MIN / -1), Python's signs for floor division and remainder, power by squaring, clip.
_INT_HELPERS: Final = r"""
FN T T_floordiv(T a, T b) {
  if (b == (T)0) return (T)0;
  if ((T)(b + (T)1) == (T)0 && (T)-1 < (T)0) return (T)((U)0 - (U)a);
  T q = (T)(a / b);
  if ((T)-1 < (T)0 && (T)(a % b) != (T)0 && ((a < (T)0) != (b < (T)0))) q -= (T)1;
  return q;
}
FN T T_rem(T a, T b) {
  if (b == (T)0) return (T)0;
  if ((T)(b + (T)1) == (T)0 && (T)-1 < (T)0) return (T)0;
  T r = (T)(a % b);
  if ((T)-1 < (T)0 && r != (T)0 && ((r < (T)0) != (b < (T)0))) r += b;
  return r;
}
FN T T_pow(T a, T b) {
  if ((T)-1 < (T)0 && b < (T)0) return (T)(a == (T)1 ? 1 : (a == (T)-1 ? ((b & (T)1) ? -1 : 1) : 0));
  U r = 1, base = (U)a;
  U64 e = (U64)b;
  while (e) { if (e & 1) r *= base; base *= base; e >>= 1; }
  return (T)r;
}
FN T T_clip(T x, T lo, T hi) {
  T r = x < lo ? lo : x;
  return r > hi ? hi : r;
}
"""
# Complex numbers of one precision: a struct C of two reals R (OpenCL C has no operator overloading, so the
# generated code calls these). Formulas follow C99 Annex G's where a plain one would lose an infinity.
_COMPLEX_HELPERS: Final = r"""
typedef struct { R re; R im; } C;
FN C C_make(R re, R im) { C z; z.re = re; z.im = im; return z; }
FN C C_add(C a, C b) { return C_make(a.re + b.re, a.im + b.im); }
FN C C_sub(C a, C b) { return C_make(a.re - b.re, a.im - b.im); }
FN C C_mul(C a, C b) { return C_make(a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re); }
FN C C_div(C a, C b) {
  R r, d;
  if (fabs(b.re) >= fabs(b.im)) {
    if (b.re == (R)0 && b.im == (R)0) return C_make(a.re / fabs(b.re), a.im / fabs(b.re));
    r = b.im / b.re; d = b.re + b.im * r;
    return C_make((a.re + a.im * r) / d, (a.im - a.re * r) / d);
  }
  r = b.re / b.im; d = b.re * r + b.im;
  return C_make((a.re * r + a.im) / d, (a.im * r - a.re) / d);
}
FN C C_neg(C a) { return C_make(-a.re, -a.im); }
FN C C_conj(C a) { return C_make(a.re, -a.im); }
FN R C_abs(C a) { return hypot(a.re, a.im); }
FN int C_eq(C a, C b) { return a.re == b.re && a.im == b.im; }
FN int C_isnan(C a) { return isnan(a.re) || isnan(a.im); }
FN int C_isinf(C a) { return isinf(a.re) || isinf(a.im); }
FN int C_isfinite(C a) { return isfinite(a.re) && isfinite(a.im); }
FN C C_round(C a) { return C_make(rint(a.re), rint(a.im)); }
FN C C_square(C a) { return C_mul(a, a); }
FN C C_reciprocal(C a) { return C_div(C_make((R)1, (R)0), a); }
FN C C_sign(C a) {
  if (a.re == (R)0 && a.im == (R)0) return C_make((R)0, (R)0);
  R m = hypot(a.re, a.im);
  return C_make(a.re / m, a.im / m);
}
FN C C_exp(C a) {
  if (a.im == (R)0) return C_make(exp(a.re), a.im);
  if (isinf(a.re) && !isfinite(a.im)) return a.re < (R)0 ? C_make((R)0, (R)0) : C_make(a.re, (R)GB_NAN);
  R e = exp(a.re);
  return C_make(e * cos(a.im), e * sin(a.im));
}
FN C C_log(C a) { return C_make(log(hypot(a.re, a.im)), atan2(a.im, a.re)); }
FN C C_sqrt(C a) {
  if (a.re == (R)0 && a.im == (R)0) return C_make((R)0, a.im);
  if (isinf(a.im)) return C_make((R)GB_INF, a.im);
  if (isnan(a.re)) return C_make(a.re, a.re + a.im);
  if (isinf(a.re)) {
    if (a.re > (R)0) return C_make(a.re, isnan(a.im) ? a.im : copysign((R)0, a.im));
    return C_make(isnan(a.im) ? a.im : (R)0, copysign((R)GB_INF, a.im));
  }
  R t = sqrt((fabs(a.re) + hypot(a.re, a.im)) * (R)0.5);
  if (a.re >= (R)0) return C_make(t, a.im / (t + t));
  return C_make(fabs(a.im) / (t + t), copysign(t, a.im));
}
FN C C_expm1(C a) {
  if (a.re == (R)0 && a.im == (R)0) return C_make((R)0, a.im);
  if (a.im == (R)0) return C_make(expm1(a.re), a.im);
  if (isinf(a.re) && !isfinite(a.im)) return a.re < (R)0 ? C_make((R)-1, (R)0) : C_make(a.re, (R)GB_NAN);
  R e = expm1(a.re), s = sin((R)0.5 * a.im);
  return C_make(e * cos(a.im) - (R)2 * s * s, (e + (R)1) * sin(a.im));
}
FN C C_log1p(C a) {
  R x = a.re + (R)1;
  if (fabs(a.re) < (R)0.5 && fabs(a.im) < (R)0.5)
    return C_make((R)0.5 * log1p(a.re * (a.re + (R)2) + a.im * a.im), atan2(a.im, x));
  return C_log(C_make(x, a.im));
}
FN C C_log2(C a) { C l = C_log(a); return C_make(l.re * (R)1.442695040888963407359924681001892137,
                                                 l.im * (R)1.442695040888963407359924681001892137); }
FN C C_log10(C a) { C l = C_log(a); return C_make(l.re * (R)0.434294481903251827651128918916605082,
                                                  l.im * (R)0.434294481903251827651128918916605082); }
FN C C_pow(C a, C b) {
  if (b.re == (R)0 && b.im == (R)0) return C_make((R)1, (R)0);
  if (a.re == (R)0 && a.im == (R)0) {
    if (b.im == (R)0 && b.re > (R)0) return C_make((R)0, (R)0);
    return C_make((R)GB_NAN, (R)GB_NAN);
  }
  if (b.im == (R)0 && a.im == (R)0 && a.re > (R)0) return C_make(pow(a.re, b.re), (R)0);
  return C_exp(C_mul(b, C_log(a)));
}
FN C C_sinh(C a) {
  R x = a.re, y = a.im;
  if (isfinite(x) && isfinite(y)) {
    if (y == (R)0) return C_make(sinh(x), y);
    return C_make(sinh(x) * cos(y), cosh(x) * sin(y));
  }
  if (x == (R)0) return C_make(x, y - y);
  if (y == (R)0) return C_make(x, y);
  if (isinf(x)) return isfinite(y) ? C_make(x * cos(y), (R)GB_INF * sin(y)) : C_make(x, y - y);
  return C_make((x * x) * (y - y), (x + x) * (y - y));
}
FN C C_cosh(C a) {
  R x = a.re, y = a.im;
  if (isfinite(x) && isfinite(y)) {
    if (y == (R)0) return C_make(cosh(x), x * y);
    return C_make(cosh(x) * cos(y), sinh(x) * sin(y));
  }
  if (x == (R)0) return C_make(y - y, (R)0);
  if (y == (R)0) return C_make(x * x, copysign((R)0, x) * y);
  if (isinf(x)) return isfinite(y) ? C_make((R)GB_INF * cos(y), x * sin(y)) : C_make(x * x, x * (y - y));
  return C_make((x * x) * (y - y), (x + x) * (y - y));
}
FN C C_tanh(C a) {
  R x = a.re, y = a.im;
  if (isnan(x)) return C_make(x, y == (R)0 ? y : x);
  if (isinf(x)) return C_make(copysign((R)1, x), copysign((R)0, y));
  if (!isfinite(y)) return C_make(x == (R)0 ? x : y - y, y - y);
  if (fabs(x) > (R)20) return C_make(copysign((R)1, x), (R)4 * sin(y) * cos(y) * exp((R)-2 * fabs(x)));
  R d = cosh((R)2 * x) + cos((R)2 * y);
  return C_make(sinh((R)2 * x) / d, sin((R)2 * y) / d);
}
FN C C_sin(C a) { C s = C_sinh(C_make(-a.im, a.re)); return C_make(s.im, -s.re); }
FN C C_cos(C a) { return C_cosh(C_make(-a.im, a.re)); }
FN C C_tan(C a) { C t = C_tanh(C_make(-a.im, a.re)); return C_make(t.im, -t.re); }
FN C C_asinh(C a) {
  /* odd and conjugate-symmetric: computed for |x| + i|y|, then the signs restored */
  R ax = fabs(a.re), ay = fabs(a.im), re, im;
  if (isnan(ax)) { re = isinf(ay) ? (R)GB_INF : ax; im = ay == (R)0 ? ay : (R)GB_NAN; }
  else if (isnan(ay)) { re = isinf(ax) ? ax : ay; im = ay; }
  else if (isinf(ax) || isinf(ay)) {
    re = (R)GB_INF;
    im = isinf(ax) ? (isinf(ay) ? (R)GB_PI_4 : (R)0)
                   : (R)GB_PI_2;
  } else {
    C z = C_make(ax, ay);
    /* far out, asinh(z) = log(2z) to working precision, and z*z would overflow */
    C w = ax > (R)1e8 || ay > (R)1e8 ? C_log(z) : C_log(C_add(z, C_sqrt(C_add(C_mul(z, z), C_make((R)1, (R)0)))));
    re = ax > (R)1e8 || ay > (R)1e8 ? w.re + (R)GB_LN2 : w.re; im = w.im;
  }
  return C_make(copysign(re, a.re), copysign(im, a.im));
}
FN C C_asin(C a) { C s = C_asinh(C_make(-a.im, a.re)); return C_make(s.im, -s.re); }
FN C C_acosh(C a) {
  /* conjugate-symmetric: computed for x + i|y|, then the imaginary sign restored */
  R x = a.re, ay = fabs(a.im), re, im;
  if (isnan(x)) { re = isinf(ay) ? (R)GB_INF : x; im = x; }
  else if (isnan(ay)) { re = isinf(x) ? (R)GB_INF : ay; im = x == (R)0 ? (R)GB_PI_2 : ay; }
  else if (isinf(x)) {
    re = (R)GB_INF;
    im = isinf(ay) ? (x > (R)0 ? (R)GB_PI_4 : (R)(3 * GB_PI_4)) : (x > (R)0 ? (R)0 : (R)(2 * GB_PI_2));
  } else if (isinf(ay)) { re = (R)GB_INF; im = (R)GB_PI_2; }
  else {
    C z = C_make(x, ay);
    int far = fabs(x) > (R)1e8 || ay > (R)1e8;  /* acosh(z) = log(2z) to working precision */
    C w = far ? C_log(z)
              : C_log(C_add(z, C_mul(C_sqrt(C_add(z, C_make((R)1, (R)0))), C_sqrt(C_sub(z, C_make((R)1, (R)0))))));
    re = far ? w.re + (R)GB_LN2 : w.re; im = w.im;
  }
  return C_make(re, copysign(im, a.im));
}
FN C C_acos(C a) {
  /* acos(z) = -i acosh(z) in the upper half plane; conjugate-symmetric */
  C w = C_acosh(C_make(a.re, fabs(a.im)));
  R im = -w.re;
  return C_make(w.im, signbit(a.im) ? -im : im);
}
FN C C_atanh(C a) {
  /* odd and conjugate-symmetric: computed for |x| + i|y|, then the signs restored */
  R ax = fabs(a.re), ay = fabs(a.im), re, im;
  if (isnan(ax)) { re = isinf(ay) ? (R)0 : ax; im = isinf(ay) ? (R)GB_PI_2 : ax; }
  else if (isnan(ay)) { re = (isinf(ax) || ax == (R)0) ? (R)0 : ay; im = ay; }
  else if (isinf(ax) || isinf(ay)) { re = (R)0; im = (R)GB_PI_2; }
  else if (ax == (R)1 && ay == (R)0) { re = (R)GB_INF; im = (R)0; }
  else {
    C z = C_make(ax, ay);
    C l = C_sub(C_log1p(z), C_log1p(C_neg(z)));
    re = (R)0.5 * l.re; im = (R)0.5 * l.im;
  }
  return C_make(copysign(re, a.re), copysign(im, a.im));
}
FN C C_atan(C a) { C t = C_atanh(C_make(-a.im, a.re)); return C_make(t.im, -t.re); }
"""


_TOKEN = re.compile(r"\b([RTUC])(?=\b|_)")


def _subst(template: str, names: dict[str, str]) -> str:
    """``template`` with its one-letter type names (R real, T integer, U unsigned, C complex) replaced."""
    return _TOKEN.sub(lambda m: names[m.group(1)], template)


def _functions(template: str, names: dict[str, str]) -> list[tuple[str, str]]:
    """(name, text) of each top-level definition in ``template`` (with its type names replaced), in order."""
    text = _subst(template, names)
    parts = re.split(r"\n(?=FN |typedef )", text.strip("\n"))
    out = []
    for part in parts:
        match = re.search(r"(\w+)\s*\(", part) if part.startswith("FN ") else re.search(r"}\s*(\w+);", part)
        assert match is not None
        out.append((match.group(1), part + "\n"))
    return out


def _helper_table() -> dict[str, list[tuple[str, str]]]:
    table: dict[str, list[tuple[str, str]]] = {}
    for t in ("F32", "F64"):
        table[t] = _functions(_REAL_HELPERS, {"R": t})
    for t in ("I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64"):
        table[t] = _functions(_INT_HELPERS, {"T": t, "U": _UNSIGNED[t]})
    for c in ("C64", "C128"):
        table[c] = _functions(_COMPLEX_HELPERS, {"C": c, "R": _REAL_OF[c]})
    return table


_HELPERS: Final = _helper_table()
_WORD = re.compile(r"\w+")


def _source(types: set[str], body: str) -> str:
    """The prelude, the helpers ``body`` uses (directly or through other helpers), and ``body``."""
    fp64 = _FP64 if types & {"F64", "C128"} else ""
    helpers = [item for t in ("F32", "F64", "I8", "I16", "I32", "I64", "U8", "U16", "U32", "U64", "C64", "C128")
               if t in types for item in _HELPERS[t]]
    used = set(_WORD.findall(body))
    while True:  # a helper is kept if the body or a kept helper names it
        grown = used | {w for name, text in helpers if name in used for w in _WORD.findall(text)}
        if grown == used:
            break
        used = grown
    return fp64 + _PRELUDE + "".join(text for name, text in helpers if name in used) + body


# -- casts -----------------------------------------------------------------------------------------------------
def cast(src: np.dtype[Any], dst: np.dtype[Any], expr: str) -> str:
    """C for ``expr`` (a value of ``src``) converted to ``dst`` as ``astype`` converts (complex to real keeps the
    real part; anything to bool is ``!= 0``)."""
    if src == dst:
        return expr
    s, d = ctype(src), ctype(dst)
    if dst.kind == "b":
        if src.kind == "c":
            return f"(U8)(({expr}).re != 0 || ({expr}).im != 0)"
        return f"(U8)(({expr}) != 0)"
    if dst.kind == "c":
        r = _REAL_OF[d]
        if src.kind == "c":
            return f"{d}_make(({r})({expr}).re, ({r})({expr}).im)"
        return f"{d}_make(({r})({expr}), ({r})0)"
    if src.kind == "c":
        return f"({d})(({expr}).re)"
    del s
    return f"({d})({expr})"


# -- the operation table ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    """One elementwise operation: C per kind of its compute dtype ("b" bool, "i" signed, "u" unsigned, "f" real
    floating, "c" complex), with ``{a}``, ``{b}``, ``{c}`` for its operands (of the compute dtype, except inputs
    marked "bool" in ``args``), ``{T}`` for the compute dtype's C type, ``{U}`` its unsigned type, ``{BITS}`` its
    width. ``result``: "same" (the compute dtype), "bool" (an int 0/1) or "real" (the real type of a complex)."""

    arity: int
    code: dict[str, str]
    result: str = "same"
    args: tuple[str, ...] = ()  # per input: "T" (the compute dtype) or "bool"; empty: all "T"


def _float_fn(name: str) -> Op:
    return Op(1, {"f": f"{name}({{a}})", "c": f"{{T}}_{name}({{a}})"})


_INT_SAME = "{a}"

ELEMENTWISE_OPS: Final[dict[str, Op]] = {
    "copy": Op(1, {k: "{a}" for k in "biufc"}),
    "abs": Op(1, {"i": "({a} < 0 ? ({T})(({U})0 - ({U}){a}) : {a})", "u": "{a}", "f": "fabs({a})",
                  "c": "{T}_abs({a})"}, "real"),
    **{name: _float_fn(name) for name in ("acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "exp",
                                          "expm1", "log", "log1p", "log2", "log10", "sin", "sinh", "sqrt", "tan",
                                          "tanh")},
    "ceil": Op(1, {"i": _INT_SAME, "u": _INT_SAME, "f": "ceil({a})"}),
    "floor": Op(1, {"i": _INT_SAME, "u": _INT_SAME, "f": "floor({a})"}),
    "trunc": Op(1, {"i": _INT_SAME, "u": _INT_SAME, "f": "trunc({a})"}),
    "round": Op(1, {"i": _INT_SAME, "u": _INT_SAME, "f": "rint({a})", "c": "{T}_round({a})"}),
    "conj": Op(1, {"i": "{a}", "u": "{a}", "f": "{a}", "c": "{T}_conj({a})"}),
    "real": Op(1, {"i": "{a}", "u": "{a}", "f": "{a}", "c": "({a}).re"}, "real"),
    "imag": Op(1, {"i": "({T})0", "u": "({T})0", "f": "({T})0", "c": "({a}).im"}, "real"),
    "isfinite": Op(1, {"b": "1", "i": "1", "u": "1", "f": "isfinite({a})", "c": "{T}_isfinite({a})"}, "bool"),
    "isinf": Op(1, {"b": "0", "i": "0", "u": "0", "f": "isinf({a})", "c": "{T}_isinf({a})"}, "bool"),
    "isnan": Op(1, {"b": "0", "i": "0", "u": "0", "f": "isnan({a})", "c": "{T}_isnan({a})"}, "bool"),
    "logical_not": Op(1, {"b": "!{a}"}, "bool"),
    "bitwise_invert": Op(1, {"b": "!{a}", "i": "~{a}", "u": "~{a}"}),
    "negative": Op(1, {"i": "({T})(({U})0 - ({U}){a})", "u": "({T})(({U})0 - {a})", "f": "-{a}",
                       "c": "{T}_neg({a})"}),
    "positive": Op(1, {k: "{a}" for k in "iufc"}),
    "reciprocal": Op(1, {"f": "(({T})1 / {a})", "c": "{T}_reciprocal({a})"}),
    "sign": Op(1, {"i": "({T})(({a} > 0) - ({a} < 0))", "u": "({T})({a} > 0)",
                   "f": "({a} > 0 ? ({T})1 : ({a} < 0 ? ({T})-1 : ({a} == 0 ? ({T})0 : {a})))",
                   "c": "{T}_sign({a})"}),
    "signbit": Op(1, {"f": "signbit({a})"}, "bool"),
    "square": Op(1, {"i": "({T})(({U}){a} * ({U}){a})", "u": "({T})({a} * {a})", "f": "({a} * {a})",
                     "c": "{T}_square({a})"}),
    "add": Op(2, {"i": "({T})(({U}){a} + ({U}){b})", "u": "({T})({a} + {b})", "f": "({a} + {b})",
                  "c": "{T}_add({a}, {b})"}),
    "subtract": Op(2, {"i": "({T})(({U}){a} - ({U}){b})", "u": "({T})({a} - {b})", "f": "({a} - {b})",
                       "c": "{T}_sub({a}, {b})"}),
    "multiply": Op(2, {"i": "({T})(({U}){a} * ({U}){b})", "u": "({T})({a} * {b})", "f": "({a} * {b})",
                       "c": "{T}_mul({a}, {b})"}),
    "divide": Op(2, {"f": "({a} / {b})", "c": "{T}_div({a}, {b})"}),
    "atan2": Op(2, {"f": "atan2({a}, {b})"}),
    "copysign": Op(2, {"f": "copysign({a}, {b})"}),
    "hypot": Op(2, {"f": "hypot({a}, {b})"}),
    "nextafter": Op(2, {"f": "nextafter({a}, {b})"}),
    "logaddexp": Op(2, {"f": "{T}_logaddexp({a}, {b})"}),
    "maximum": Op(2, {"i": "({a} > {b} ? {a} : {b})", "u": "({a} > {b} ? {a} : {b})",
                      "f": "(({a} > {b} || isnan({a})) ? {a} : {b})"}),
    "minimum": Op(2, {"i": "({a} < {b} ? {a} : {b})", "u": "({a} < {b} ? {a} : {b})",
                      "f": "(({a} < {b} || isnan({a})) ? {a} : {b})"}),
    "pow": Op(2, {"i": "{T}_pow({a}, {b})", "u": "{T}_pow({a}, {b})", "f": "pow({a}, {b})",
                  "c": "{T}_pow({a}, {b})"}),
    "floor_divide": Op(2, {k: "{T}_floordiv({a}, {b})" for k in "iuf"}),
    "remainder": Op(2, {k: "{T}_rem({a}, {b})" for k in "iuf"}),
    "equal": Op(2, {**{k: "({a} == {b})" for k in "biuf"}, "c": "{T}_eq({a}, {b})"}, "bool"),
    "not_equal": Op(2, {**{k: "({a} != {b})" for k in "biuf"}, "c": "!{T}_eq({a}, {b})"}, "bool"),
    "less": Op(2, {k: "({a} < {b})" for k in "iuf"}, "bool"),
    "less_equal": Op(2, {k: "({a} <= {b})" for k in "iuf"}, "bool"),
    "greater": Op(2, {k: "({a} > {b})" for k in "iuf"}, "bool"),
    "greater_equal": Op(2, {k: "({a} >= {b})" for k in "iuf"}, "bool"),
    "bitwise_and": Op(2, {k: "({T})({a} & {b})" for k in "biu"}),
    "bitwise_or": Op(2, {k: "({T})({a} | {b})" for k in "biu"}),
    "bitwise_xor": Op(2, {k: "({T})({a} ^ {b})" for k in "biu"}),
    "bitwise_left_shift": Op(2, {k: "((U64){b} >= {BITS} ? ({T})0 : ({T})(({U}){a} << {b}))" for k in "iu"}),
    "bitwise_right_shift": Op(2, {"i": "((U64){b} >= {BITS} ? ({T})({a} < 0 ? -1 : 0) : ({T})({a} >> {b}))",
                                  "u": "((U64){b} >= {BITS} ? ({T})0 : ({T})({a} >> {b}))"}),
    "logical_and": Op(2, {"b": "({a} && {b})"}, "bool"),
    "logical_or": Op(2, {"b": "({a} || {b})"}, "bool"),
    "logical_xor": Op(2, {"b": "(({a} != 0) != ({b} != 0))"}, "bool"),
    "where": Op(3, {k: "({a} ? {b} : {c})" for k in "biufc"}, args=("bool", "T", "T")),
    "clip": Op(3, {k: "{T}_clip({a}, {b}, {c})" for k in "iuf"}),
    "clip_min": Op(2, {"i": "({a} < {b} ? {b} : {a})", "u": "({a} < {b} ? {b} : {a})",
                       "f": "(isnan({b}) || {a} < {b} ? {b} : {a})"}),
    "clip_max": Op(2, {"i": "({a} > {b} ? {b} : {a})", "u": "({a} > {b} ? {b} : {a})",
                       "f": "(isnan({b}) || {a} > {b} ? {b} : {a})"}),
}


def result_dtype(fn: str, compute: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype of ``fn``'s value computed in ``compute`` (before the store converts it to the output's)."""
    kind = ELEMENTWISE_OPS[fn].result
    if kind == "bool":
        return np.dtype(np.bool_)
    if kind == "real" and compute.kind == "c":
        return np.dtype(np.float32 if compute.itemsize == 8 else np.float64)
    return compute


def _expr(fn: str, compute: np.dtype[Any], operands: Sequence[str]) -> str:
    op = ELEMENTWISE_OPS[fn]
    kind = "b" if compute.kind == "b" else compute.kind
    try:
        template = op.code[kind]
    except KeyError:
        raise TypeError(f"{fn} is not defined for {compute}") from None
    t = ctype(compute)
    return template.format(*operands, **dict(zip("abc", operands, strict=False)), T=t,
                           U=_UNSIGNED.get(t, t), BITS=compute.itemsize * 8)


# -- reductions ------------------------------------------------------------------------------------------------
_SECOND_PASS: Final = {"sumsq": "sum", "count": "sum"}  # how a split reduction combines its partial values
REDUCTIONS: Final = ("sum", "prod", "max", "min", "all", "any", "argmax", "argmin", "sumsq", "count")


# -- plans -----------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Plan:
    kernel: Kernel
    grid: int
    block: int
    tail: list[Any]  # the args after the operands': [meta buffer,] element count(s)
    meta: Storage | None  # keeps the meta buffer alive while the plan is cached
    partials: View | None = None  # a split reduction's first pass writes here (see Kernels.reduce)
    partials_storage: Storage | None = None


def _collapse(shape: tuple[int, ...], strides: Sequence[tuple[int, ...]]) -> tuple[list[int], list[list[int]]]:
    """The fewest dimensions addressing every operand as ``shape`` and ``strides`` do: size-1 dimensions dropped,
    neighbours merged where each operand's outer stride is its inner stride times the inner extent."""
    dims: list[int] = []
    per: list[list[int]] = [[] for _ in strides]
    for k, extent in enumerate(shape):
        if extent == 1:
            continue
        if dims and all(p[-1] == s[k] * extent for p, s in zip(per, strides, strict=True)):
            dims[-1] *= extent
            for p, s in zip(per, strides, strict=True):
                p[-1] = s[k]
            continue
        dims.append(extent)
        for p, s in zip(per, strides, strict=True):
            p.append(s[k])
    return dims, per


class Kernels:
    """The generated kernels of one context (one device session)."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._compiled: dict[tuple[Any, ...], Kernel] = {}
        self._plans: OrderedDict[tuple[Any, ...], _Plan] = OrderedDict()
        self._names = itertools.count()
        self._fp64: bool | None = None
        info = ctx.gpu.device_info()
        self._cuda = info.backend == "cuda"
        block = 256
        while block > max(info.max_threads_per_block, 1):
            block //= 2
        self.block = block
        self._grid_cap = max(1, min(65535, max(info.multiprocessor_count, 1) * 32))
        self.compiles = 0  # how many kernels this object compiled (tests check that a repeat compiles none)

    # -- capabilities ------------------------------------------------------------------------------------------
    def supports(self, dtype: np.dtype[Any]) -> bool:
        """Whether the device computes in ``dtype`` (float64 and complex128 need fp64 on OpenCL: probed once)."""
        if self._cuda or dtype.kind not in "fc" or dtype.itemsize * (2 if dtype.kind == "f" else 1) < 16:
            return True
        if self._fp64 is None:
            try:
                src = _FP64 + _PRELUDE + "KERNEL void gb_probe(GLOBAL F64* o) { o[0] = sqrt(o[0]) + 1.0; }\n"
                self._ctx.gpu.compile_kernel(src, "gb_probe")
                self._fp64 = True
            except GpuBrokerError:
                self._fp64 = False
        return self._fp64

    # -- compiling ---------------------------------------------------------------------------------------------
    def _compile(self, key: tuple[Any, ...], make: Any) -> Kernel:
        kernel = self._compiled.get(key)
        if kernel is None:
            name = f"gb_{next(self._names)}"
            source = make(name)
            kernel = self._ctx.gpu.compile_kernel(source, name)
            self.compiles += 1
            self._compiled[key] = kernel
        return kernel

    def _meta(self, values: list[int]) -> Storage:
        meta = np.asarray(values, dtype=np.int64)
        storage = self._ctx.allocate(meta.nbytes)
        self._ctx.gpu.copy_h2d(meta, storage.buffer)
        return storage

    def _grid(self, n: int) -> int:
        return min(-(-n // self.block), self._grid_cap)

    def _lookup(self, key: tuple[Any, ...]) -> _Plan | None:
        """The cached plan for ``key`` (marked recently used), or None."""
        plan = self._plans.get(key)
        if plan is not None:
            try:
                self._plans.move_to_end(key)
            except KeyError:  # evicted by another thread meanwhile: the plan in hand still works
                pass
        return plan

    def _remember(self, key: tuple[Any, ...], plan: _Plan) -> _Plan:
        with self._lock:
            self._plans[key] = plan
            if len(self._plans) > _PLANS_MAX:
                self._plans.popitem(last=False)
        return plan

    # -- elementwise -------------------------------------------------------------------------------------------
    def elementwise(self, fn: str, out: View, inputs: Sequence[View], dtype: np.dtype[Any] | None = None,
                    scalars: Sequence[np.generic] = ()) -> None:
        """``out[i] = fn(inputs[0][i], ...)`` for every index of ``out.shape``; every input is already broadcast
        to ``out.shape`` (stride 0 where it repeats). ``dtype``: the dtype ``fn`` computes in (default: the
        output's where ``fn`` gives its operands' dtype, else the promoted inputs'); each input is converted to it
        as it is read (so a promotion costs no separate copy), and the value to ``out.dtype`` as it is stored."""
        key = (fn, dtype, out.dtype, out.shape, out.strides, *[(v.dtype, v.strides) for v in inputs])
        plan = self._lookup(key)
        if plan is None:
            if out.size == 0:
                return
            plan = self._plan_elementwise(key, fn, out, inputs, dtype, scalars)
        args: list[Any] = [out.buffer, np.int64(out.offset)]
        for v in inputs:
            args.append(v.buffer)
            args.append(np.int64(v.offset))
        args.extend(scalars)
        args.extend(plan.tail)
        self._ctx.gpu.execute_kernel(plan.kernel, plan.grid, plan.block, args)

    def _plan_elementwise(self, key: tuple[Any, ...], fn: str, out: View, inputs: Sequence[View],
                          dtype: np.dtype[Any] | None, scalars: Sequence[np.generic]) -> _Plan:
        op = ELEMENTWISE_OPS.get(fn)
        if op is None or op.arity != len(inputs):
            raise ValueError(f"no elementwise operation {fn!r} of {len(inputs)} operand(s)")
        compute = dtype
        if compute is None:
            typed = [v.dtype for v, a in zip(inputs, op.args or ("T",) * op.arity, strict=True) if a == "T"]
            if op.result == "same" and fn != "copy":
                compute = out.dtype
            else:
                compute = typed[0]
                for d in typed[1:]:
                    from gpubroker.client.array._dtypes import promote

                    compute = promote(compute, d)
            if fn == "copy":
                compute = out.dtype
        value_dtype = result_dtype(fn, compute)
        arg_dtypes = [np.dtype(np.bool_) if a == "bool" else compute
                      for a in (op.args or ("T",) * op.arity)]
        dims, per = _collapse(out.shape, [out.strides, *[v.strides for v in inputs]])
        n = out.size
        contiguous = len(dims) <= 1 and all(p[0] == 1 for p in per[:1]) if dims else True
        modes: tuple[str, ...] = ()
        if contiguous:
            modes = tuple("c" if not dims or p[0] == 1 else ("s" if p[0] == 0 else "x") for p in per[1:])
            contiguous = "x" not in modes
        small = n < _SMALL_INDEX
        variant: tuple[Any, ...] = ("c", modes) if contiguous else ("s", len(dims), small)
        ckey = ("ew", fn, compute, out.dtype, tuple(v.dtype for v in inputs), tuple(type(s) for s in scalars),
                variant)

        def make(name: str) -> str:
            return self._source_elementwise(name, fn, compute, value_dtype, out.dtype, inputs, arg_dtypes,
                                            scalars, variant)

        kernel = self._compile(ckey, make)
        tail: list[Any] = []
        meta = None
        if not contiguous:
            meta = self._meta([*dims, *[s for p in per for s in p]])
            tail.append(meta.buffer)
        tail.append(np.int64(n))
        return self._remember(key, _Plan(kernel, self._grid(n), self.block, tail, meta))

    def _source_elementwise(self, name: str, fn: str, compute: np.dtype[Any], value: np.dtype[Any],
                            out_dtype: np.dtype[Any], inputs: Sequence[View], arg_dtypes: Sequence[np.dtype[Any]],
                            scalars: Sequence[np.generic], variant: tuple[Any, ...]) -> str:
        types = {ctype(d) for d in (compute, value, out_dtype, *arg_dtypes, *(v.dtype for v in inputs))}
        params = [f"GLOBAL {ctype(out_dtype)}* o", "I64 oo"]
        for k, v in enumerate(inputs):
            params += [f"GLOBAL const {ctype(v.dtype)}* a{k}", f"I64 a{k}o"]
        for k, s in enumerate(scalars):
            params.append(f"{ctype(np.asarray(s).dtype)} s{k}")
        ops = [f"s{k}" for k in range(len(scalars))]
        if variant[0] == "c":
            params.append("I64 n")
            modes = variant[1]
            loads = [f"a{k}[a{k}o + i]" if m == "c" else f"a{k}[a{k}o]" for k, m in enumerate(modes)]
            prologue, index, store_at = "", "", "o[oo + i]"
        else:
            ndim, small = variant[1], variant[2]
            params += ["GLOBAL const I64* meta", "I64 n"]
            idx = "U32" if small else "I64"
            nops = len(inputs) + 1
            prologue = "".join(f"  const {idx} d{d} = ({idx})meta[{d}];\n" for d in range(ndim))
            prologue += "".join(f"  const I64 t{p}_{d} = meta[{ndim + p * ndim + d}];\n"
                                for p in range(nops) for d in range(ndim))
            index = f"    {idx} r = ({idx})i;\n    I64 p0 = oo" + "".join(
                f", p{k + 1} = a{k}o" for k in range(len(inputs))) + ";\n"
            for d in range(ndim - 1, -1, -1):
                index += f"    {{ {idx} c = " + (f"r % d{d}; r /= d{d};" if d else "r;")
                index += "".join(f" p{p} += (I64)c * t{p}_{d};" for p in range(nops)) + " }\n"
            loads = [f"a{k}[p{k + 1}]" for k in range(len(inputs))]
            store_at = "o[p0]"
        operands = [cast(v.dtype, d, load) for v, d, load in zip(inputs, arg_dtypes, loads, strict=True)] + ops
        value_expr = _expr(fn, compute, operands)
        if ELEMENTWISE_OPS[fn].result == "bool":
            stored = cast(np.dtype(np.int32), out_dtype, value_expr) if out_dtype.kind != "b" else \
                f"(U8)(({value_expr}) != 0)"
        else:
            stored = cast(value, out_dtype, value_expr)
        body = (f"KERNEL void {name}({', '.join(params)}) {{\n{prologue}"
                f"  for (I64 i = GID; i < n; i += GSIZE) {{\n{index}    {store_at} = {stored};\n  }}\n}}\n")
        return _source(types, body)

    # -- copies and fills --------------------------------------------------------------------------------------
    def copy(self, out: View, src: View) -> None:
        """``out[i] = cast(src[i])``: ``src`` broadcast to ``out.shape``, any dtype to any dtype (astype's rules)."""
        self.elementwise("copy", out, [src], out.dtype)

    def fill(self, out: View, value: bool | int | float | complex) -> None:
        """Every element of ``out`` set to ``value`` (converted to ``out.dtype``)."""
        dt = out.dtype
        scalars: list[np.generic]
        if dt.kind == "c":
            real = np.float32 if dt.itemsize == 8 else np.float64
            z = complex(value)
            scalars = [real(z.real), real(z.imag)]
            fn = "fill_c"
        elif dt.kind == "b":
            scalars = [np.uint8(1 if value else 0)]
            fn = "fill"
        else:
            scalars = [dt.type(value)]
            fn = "fill"
        self._generated(fn, out, scalars)

    def arange(self, out: View, start: int | float, step: int | float) -> None:
        """1-d ``out[i] = start + i * step`` (computed in double precision for floating dtypes where the device has
        it, else in single)."""
        dt = out.dtype
        scalars: list[np.generic]
        if dt.kind in "fc":
            real = np.float64 if self.supports(np.dtype(np.float64)) else np.float32
            scalars = [real(start), real(step)]
        else:
            scalars = [np.int64(start), np.int64(step)]
        self._generated("arange", out, scalars)

    def _generated(self, fn: str, out: View, scalars: list[np.generic]) -> None:
        """A kernel with no array inputs (fill, arange) over ``out``, contiguous or strided."""
        key = (fn, out.dtype, out.shape, out.strides, tuple(type(s) for s in scalars))
        plan = self._lookup(key)
        if plan is None:
            if out.size == 0:
                return
            plan = self._plan_generated(key, fn, out, scalars)
        args: list[Any] = [out.buffer, np.int64(out.offset), *scalars, *plan.tail]
        self._ctx.gpu.execute_kernel(plan.kernel, plan.grid, plan.block, args)

    def _plan_generated(self, key: tuple[Any, ...], fn: str, out: View, scalars: list[np.generic]) -> _Plan:
        n = out.size
        if fn == "arange":  # the value depends on the logical index: no collapsing beyond 1-d
            dims, per = ([n], [[out.strides[0]]]) if out.shape else ([], [[]])
        else:
            dims, per = _collapse(out.shape, [out.strides])
        contiguous = not dims or (len(dims) == 1 and per[0][0] == 1)
        t = ctype(out.dtype)
        sdt = [np.asarray(s).dtype for s in scalars]
        types = {t, *(ctype(d) for d in sdt)}
        params = [f"GLOBAL {t}* o", "I64 oo"] + [f"{ctype(d)} s{k}" for k, d in enumerate(sdt)]
        if fn == "fill_c":
            value = f"{t}_make(s0, s1)"
        elif fn == "fill":
            value = "s0"
        else:
            value = cast(sdt[0], out.dtype, "(s0 + (" + ctype(sdt[0]) + ")i * s1)")
        if contiguous:
            params.append("I64 n")
            at, prologue, index = "o[oo + i]", "", ""
        else:
            params += ["GLOBAL const I64* meta", "I64 n"]
            ndim = len(dims)
            prologue = "".join(f"  const I64 d{d} = meta[{d}];\n  const I64 t{d} = meta[{ndim + d}];\n"
                               for d in range(ndim))
            index = "    I64 r = i, p = oo;\n" + "".join(
                "    { I64 c = " + (f"r % d{d}; r /= d{d};" if d else "r;") + f" p += c * t{d}; }}\n"
                for d in range(ndim - 1, -1, -1))
            at = "o[p]"
        variant = "c" if contiguous else len(dims)
        ckey = ("gen", fn, out.dtype, tuple(sdt), variant)

        def make(name: str) -> str:
            body = (f"KERNEL void {name}({', '.join(params)}) {{\n{prologue}"
                    f"  for (I64 i = GID; i < n; i += GSIZE) {{\n{index}    {at} = {value};\n  }}\n}}\n")
            return _source(types, body)

        kernel = self._compile(ckey, make)
        meta = None
        tail: list[Any] = []
        if not contiguous:
            meta = self._meta([*dims, *per[0]])
            tail.append(meta.buffer)
        tail.append(np.int64(n))
        return self._remember(key, _Plan(kernel, self._grid(n), self.block, tail, meta))

    # -- reductions --------------------------------------------------------------------------------------------
    def reduce(self, fn: str, out: View, x: View, axes: tuple[int, ...], center: View | None = None) -> None:
        """``out`` = ``fn`` ("sum", "prod", "max", "min", "all", "any", "argmax", "argmin", "sumsq", "count" (of
        nonzero elements)) of ``x`` over ``axes``; ``out.shape`` is ``x.shape`` without them. "sumsq" sums
        ``(x - center)**2`` where ``center`` has ``out``'s shape (the second pass of var). Sums and products
        accumulate in ``out.dtype``; argmax and argmin give the first occurrence's flat index over ``axes``
        (C order) as int64.

        One work-group per output element: its work-items stride over the reduced elements, each accumulating
        its share, and a tree in shared memory combines the partial values pairwise. Where there are few outputs
        and many elements each (a full ``sum``), each output's elements are split in parts, one work-group each,
        into a buffer of partial values that a second pass reduces: the whole device works, and float sums stay
        close to pairwise."""
        cstrides = center.strides if center is not None else None
        key = ("reduce", fn, out.dtype, out.shape, out.strides, x.dtype, x.shape, x.strides, axes, cstrides,
               None if center is None else center.dtype)
        plan = self._lookup(key)
        if plan is None:
            if out.size == 0:
                return
            plan = self._plan_reduce(key, fn, out, x, axes, center)
        partials = plan.partials
        args: list[Any] = [out.buffer if partials is None else partials.buffer,
                           np.int64(out.offset if partials is None else 0), x.buffer, np.int64(x.offset)]
        if center is not None:
            args += [center.buffer, np.int64(center.offset)]
        args.extend(plan.tail)
        self._ctx.gpu.execute_kernel(plan.kernel, plan.grid, plan.block, args)
        if partials is not None:
            self.reduce(_SECOND_PASS.get(fn, fn), out, partials, (len(out.shape),))

    def _plan_reduce(self, key: tuple[Any, ...], fn: str, out: View, x: View, axes: tuple[int, ...],
                     center: View | None) -> _Plan:
        if fn not in REDUCTIONS:
            raise ValueError(f"no reduction {fn!r}")
        kept = [k for k in range(len(x.shape)) if k not in axes]
        if tuple(x.shape[k] for k in kept) != out.shape:
            raise ValueError(f"reduction output shape {out.shape} is not {x.shape} without axes {axes}")
        kept_strides = [tuple(x.strides[k] for k in kept), out.strides]
        if center is not None:
            kept_strides.append(center.strides)
        kdims, kper = _collapse(out.shape, kept_strides)
        rdims, rper = _collapse(tuple(x.shape[k] for k in axes), [tuple(x.strides[k] for k in axes)])
        m = 1
        for k in axes:
            m *= x.shape[k]
        nout = out.size
        block = self.block  # a work-group as small as the reduced extent allows (a row of 10: one warp)
        while block > 32 and block // 2 >= m:
            block //= 2
        variant = (len(kdims), len(rdims), m < _SMALL_INDEX and nout < _SMALL_INDEX, block)
        ckey = ("reduce", fn, out.dtype, x.dtype, None if center is None else center.dtype, variant)

        def make(name: str) -> str:
            return self._source_reduce(name, fn, out.dtype, x.dtype, None if center is None else center.dtype,
                                       variant)

        kernel = self._compile(ckey, make)
        parts = 1
        if fn not in ("argmax", "argmin") and m >= 32 * self.block:
            parts = min(-(-m // (8 * self.block)), max(1, self._grid_cap // nout))
        partials = partials_storage = None
        if parts > 1:  # the first pass writes (out.shape..., parts) partial values, contiguous
            from gpubroker.client.array._context import View as _View
            from gpubroker.client.array._context import contiguous_strides

            partials_storage = self._ctx.allocate(nout * parts * out.dtype.itemsize)
            shape = (*out.shape, parts)
            partials = _View(partials_storage.buffer, out.dtype, shape, contiguous_strides(shape), 0)
            kept_strides[1] = partials.strides[:-1]
            kdims, kper = _collapse(out.shape, kept_strides)
        chunk = -(-m // parts)
        meta = self._meta([*kdims, *[s for p in kper for s in p], *rdims, *rper[0], 0])
        tail: list[Any] = [meta.buffer, np.int64(nout), np.int64(m), np.int64(parts), np.int64(chunk),
                           np.int64(1 if parts > 1 else 0)]
        grid = min(nout * parts, 65535)
        return self._remember(key, _Plan(kernel, grid, block, tail, meta, partials, partials_storage))

    def _source_reduce(self, name: str, fn: str, out_dtype: np.dtype[Any], x_dtype: np.dtype[Any],
                       center_dtype: np.dtype[Any] | None, variant: tuple[int, int, bool, int]) -> str:
        kd, rd, small, block = variant
        idx = "U32" if small else "I64"
        ot, xt = ctype(out_dtype), ctype(x_dtype)
        arg = fn in ("argmax", "argmin")
        acc_dtype: np.dtype[Any]
        if fn in ("all", "any"):
            acc_dtype = np.dtype(np.bool_)
        elif fn == "count":
            acc_dtype = np.dtype(np.int64)
        elif fn in ("max", "min") or arg:
            acc_dtype = x_dtype
        else:
            acc_dtype = out_dtype
        at = ctype(acc_dtype)
        types = {ot, xt, at, "I64"} | ({ctype(center_dtype)} if center_dtype is not None else set())
        real = acc_dtype.kind == "f"
        if acc_dtype.kind == "f":
            lowest, highest = f"(({at})-GB_INF)", f"(({at})GB_INF)"
        elif acc_dtype.kind in "iu":
            info = np.iinfo(acc_dtype)
            suffix = "ULL" if acc_dtype.kind == "u" else "LL"
            lowest = f"(({at})({info.min}{suffix}))" if info.min != -(2**63) else f"(({at})(-{2**63 - 1}LL - 1))"
            highest = f"(({at})({info.max}{suffix}))"
        else:
            lowest = highest = f"(({at})0)"
        complex_acc = acc_dtype.kind == "c"
        combine_init = {  # {a}: the accumulated value, {b}: the next one
            "sum": (f"{at}_add({{a}}, {{b}})" if complex_acc else "{a} + {b}",
                    f"{at}_make(0, 0)" if complex_acc else f"({at})0"),
            "sumsq": ("{a} + {b}", f"({at})0"),
            "count": ("{a} + {b}", "(I64)0"),
            "prod": (f"{at}_mul({{a}}, {{b}})" if complex_acc else "{a} * {b}",
                     f"{at}_make(1, 0)" if complex_acc else f"({at})1"),
            "max": ("((!isnan({a}) && ({b} > {a} || isnan({b}))) ? {b} : {a})" if real else "({b} > {a} ? {b} : {a})",
                    lowest),
            "min": ("((!isnan({a}) && ({b} < {a} || isnan({b}))) ? {b} : {a})" if real else "({b} < {a} ? {b} : {a})",
                    highest),
            "all": ("(U8)({a} && {b})", "(U8)1"),
            "any": ("(U8)({a} || {b})", "(U8)0"),
            "argmax": ("", lowest),
            "argmin": ("", highest),
        }
        combine, init = combine_init[fn]
        if fn in ("sum", "prod") and acc_dtype.kind in "iu":
            u = _UNSIGNED[at]  # wrap around on overflow like NumPy, without signed-overflow UB
            combine = f"({at})(({u}){{a}} {'+' if fn == 'sum' else '*'} ({u}){{b}})"
        helpers = ""
        if arg:
            op = ">" if fn == "argmax" else "<"
            nan_first = "if (isnan(av)) return !isnan(bv) || ai < bi;\n  if (isnan(bv)) return 0;\n  " if real \
                else ""
            helpers = (f"FN int gb_better({at} av, I64 ai, {at} bv, I64 bi) {{\n  {nan_first}"
                       f"return av {op} bv || (av == bv && ai < bi);\n}}\n")
        params = [f"GLOBAL {ot}* o", "I64 oo", f"GLOBAL const {xt}* x", "I64 xo"]
        if center_dtype is not None:
            params += [f"GLOBAL const {ctype(center_dtype)}* cen", "I64 co"]
        params += ["GLOBAL const I64* meta", "I64 nout", "I64 m", "I64 parts", "I64 chunk", "I64 pstep"]
        nk = 3 if center_dtype is not None else 2
        pro = "".join(f"  const {idx} kd{d} = ({idx})meta[{d}];\n" for d in range(kd))
        pro += "".join(f"  const I64 kt{p}_{d} = meta[{kd + p * kd + d}];\n" for p in range(nk) for d in range(kd))
        base = kd + nk * kd
        pro += "".join(f"  const {idx} rd{d} = ({idx})meta[{base + d}];\n" for d in range(rd))
        pro += "".join(f"  const I64 rt{d} = meta[{base + rd + d}];\n" for d in range(rd))
        shared = f"  SHARED {at} sv[{block}];\n" + (f"  SHARED I64 si[{block}];\n" if arg else "")
        kidx = (f"    const I64 go = g / parts, gp = g - go * parts;\n"
                f"    const I64 j0 = gp * chunk, j1 = m < j0 + chunk ? m : j0 + chunk;\n"
                f"    {idx} r = ({idx})go;\n    I64 xb = xo, ob = oo + gp * pstep" + (", cb = co" if nk == 3 else "")
                + ";\n")
        names = ["xb", "ob", "cb"]
        for d in range(kd - 1, -1, -1):
            kidx += f"    {{ {idx} c = " + (f"r % kd{d}; r /= kd{d};" if d else "r;")
            kidx += "".join(f" {names[p]} += (I64)c * kt{p}_{d};" for p in range(nk)) + " }\n"
        ridx = f"      {idx} q = ({idx})j;\n      I64 xp = xb;\n"
        for d in range(rd - 1, -1, -1):
            ridx += f"      {{ {idx} c = " + (f"q % rd{d}; q /= rd{d};" if d else "q;") + f" xp += (I64)c * rt{d}; }}\n"
        load = cast(x_dtype, acc_dtype, "x[xp]")
        if fn == "count":
            load = f"(I64){cast(x_dtype, np.dtype(np.bool_), 'x[xp]')}"
        center_load = (f"    const {at} cv = {cast(center_dtype, acc_dtype, 'cen[cb]')};\n"
                       if center_dtype is not None else "")
        if arg:
            loop = (f"    {at} acc = {init}; I64 ai = m;\n"
                    f"    for (I64 j = j0 + LID; j < j1; j += {block}) {{\n{ridx}"
                    f"      {at} v = {load};\n      if (gb_better(v, j, acc, ai)) {{ acc = v; ai = j; }}\n    }}\n"
                    f"    sv[LID] = acc; si[LID] = ai; SYNC();\n"
                    f"    for (int s = {block // 2}; s > 0; s >>= 1) {{\n"
                    f"      if (LID < s && gb_better(sv[LID + s], si[LID + s], sv[LID], si[LID])) "
                    f"{{ sv[LID] = sv[LID + s]; si[LID] = si[LID + s]; }}\n      SYNC();\n    }}\n"
                    f"    if (LID == 0) o[ob] = {cast(np.dtype(np.int64), out_dtype, 'si[0]')};\n    SYNC();\n")
        else:
            pair = combine.format(a="sv[LID]", b="sv[LID + s]")
            step = combine.format(a="acc", b="(v - cv) * (v - cv)" if fn == "sumsq" else "v")
            loop = (f"{center_load}    {at} acc = {init};\n"
                    f"    for (I64 j = j0 + LID; j < j1; j += {block}) {{\n{ridx}"
                    f"      {at} v = {load};\n      acc = {step};\n    }}\n"
                    f"    sv[LID] = acc; SYNC();\n"
                    f"    for (int s = {block // 2}; s > 0; s >>= 1) {{\n"
                    f"      if (LID < s) sv[LID] = {pair};\n      SYNC();\n    }}\n"
                    f"    if (LID == 0) o[ob] = {cast(acc_dtype, out_dtype, 'sv[0]')};\n    SYNC();\n")
        body = (f"{helpers}KERNEL void {name}({', '.join(params)}) {{\n{shared}{pro}"
                f"  for (I64 g = GROUP; g < nout * parts; g += NGROUPS) {{\n{kidx}{loop}  }}\n}}\n")
        return _source(types, body)
