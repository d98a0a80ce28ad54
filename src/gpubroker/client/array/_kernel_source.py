"""The kernel families' sources: the templates of ``csrc/`` filled in for one operation, dtypes and layout.

Two families: *map* (``csrc/map.c.in``: one work-item per output element; the elementwise operations of
``_op_table``, and ``generated_source``'s fills and aranges, which read no array) and *reduce*
(``csrc/reduce.c.in``: one work-group per output element; the reductions of ``_reductions``). Each is generated
*contiguous* (every operand indexed by ``i`` itself, or a single repeated element) or *strided* in some number of
dimensions, reading the shape and every operand's strides from a small int64 "meta" array; ``Kernels`` chooses
(see ``_kernels``). These functions only make text: nothing here touches a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import numpy as np

from gpubroker.client.array._csource import UNSIGNED, cast, ctype, source, template
from gpubroker.client.array._op_table import ELEMENTWISE_OPS, expression
from gpubroker.client.array._reductions import REDUCTIONS, Reduction

__all__ = ["elementwise_source", "generated_source", "reduce_source"]

_MAP: Final = template("map.c")
_REDUCE: Final = template("reduce.c")
_REDUCE_VALUE: Final = template("reduce_value.c")
_REDUCE_ARG: Final = template("reduce_arg.c")
_REDUCE_ARG_BETTER: Final = template("reduce_arg.h")
_NAN_FIRST: Final = "if (isnan(av)) return !isnan(bv) || ai < bi;\n  if (isnan(bv)) return 0;\n  "

# The kernels that read no array: each output element's value from the scalar arguments s0, s1 and its index i.
_GENERATED: Final = ("fill", "fill_c", "arange")


def _walk(indent: str, idx: str, counter: str, extent: str, ndim: int, steps: Sequence[tuple[str, str]],
          widen: str = "(I64)") -> str:
    """C that splits the flat index ``counter`` into coordinates, last dimension first (extents ``{extent}{d}``),
    and moves each pointer ``target`` by ``c * {stride}{d}`` for each (target, stride) of ``steps``."""
    out = ""
    for d in range(ndim - 1, -1, -1):
        out += f"{indent}{{ {idx} c = " + (f"{counter} % {extent}{d}; {counter} /= {extent}{d};" if d else
                                           f"{counter};")
        out += "".join(f" {target} += {widen}c * {stride}{d};" for target, stride in steps) + " }\n"
    return out


def _read_meta(idx: str, extent: str, stride: str, first: int, ndim: int, operands: int) -> str:
    """C reading ``ndim`` extents (as ``idx``) and each operand's ``ndim`` strides from the meta array at ``first``."""
    out = "".join(f"  const {idx} {extent}{d} = ({idx})meta[{first + d}];\n" for d in range(ndim))
    return out + "".join(f"  const I64 {stride}{p}_{d} = meta[{first + ndim + p * ndim + d}];\n"
                         for p in range(operands) for d in range(ndim))


# -- the map family --------------------------------------------------------------------------------------------
def elementwise_source(name: str, fn: str, compute: np.dtype[Any], value: np.dtype[Any], out_dtype: np.dtype[Any],
                       input_dtypes: Sequence[np.dtype[Any]], arg_dtypes: Sequence[np.dtype[Any]],
                       scalar_dtypes: Sequence[np.dtype[Any]], variant: tuple[Any, ...]) -> str:
    """The kernel ``name`` of the elementwise operation ``fn`` computed in ``compute`` (its value of dtype
    ``value``, stored as ``out_dtype``) on inputs of ``input_dtypes``, each converted to its ``arg_dtypes`` entry as
    it is read, with scalar arguments of ``scalar_dtypes`` after them. ``variant``: ("c", modes) for the contiguous
    kernel (per input "c": indexed by i, "s": one repeated element) or ("s", ndim, small) for the strided one of
    ndim dimensions (small: indices fit 32 bits)."""
    types = {ctype(d) for d in (compute, value, out_dtype, *arg_dtypes, *input_dtypes)}
    params = [f"GLOBAL {ctype(out_dtype)}* o", "I64 oo"]
    for k, dtype in enumerate(input_dtypes):
        params += [f"GLOBAL const {ctype(dtype)}* a{k}", f"I64 a{k}o"]
    params += [f"{ctype(dtype)} s{k}" for k, dtype in enumerate(scalar_dtypes)]
    if variant[0] == "c":
        params.append("I64 n")
        loads = [f"a{k}[a{k}o + i]" if m == "c" else f"a{k}[a{k}o]" for k, m in enumerate(variant[1])]
        prologue, index, target = "", "", "o[oo + i]"
    else:
        ndim, small = variant[1], variant[2]
        params += ["GLOBAL const I64* meta", "I64 n"]
        idx = "U32" if small else "I64"
        nops = len(input_dtypes) + 1
        prologue = _read_meta(idx, "d", "t", 0, ndim, nops)
        index = f"    {idx} r = ({idx})i;\n    I64 p0 = oo" + "".join(
            f", p{k + 1} = a{k}o" for k in range(len(input_dtypes))) + ";\n"
        index += _walk("    ", idx, "r", "d", ndim, [(f"p{p}", f"t{p}_") for p in range(nops)])
        loads = [f"a{k}[p{k + 1}]" for k in range(len(input_dtypes))]
        target = "o[p0]"
    operands = [cast(dtype, arg, load) for dtype, arg, load in zip(input_dtypes, arg_dtypes, loads, strict=True)]
    operands += [f"s{k}" for k in range(len(scalar_dtypes))]
    value_expr = expression(fn, compute, operands)
    if ELEMENTWISE_OPS[fn].result == "bool":
        stored = cast(np.dtype(np.int32), out_dtype, value_expr) if out_dtype.kind != "b" else \
            f"(U8)(({value_expr}) != 0)"
    else:
        stored = cast(value, out_dtype, value_expr)
    body = _MAP.substitute(name=name, params=", ".join(params), prologue=prologue, index=index, target=target,
                           value=stored)
    return source(types, body)


def generated_source(name: str, fn: str, out_dtype: np.dtype[Any], scalar_dtypes: Sequence[np.dtype[Any]],
                     ndim: int | None) -> str:
    """The kernel ``name`` writing every element of an ``out_dtype`` output from scalars alone: "fill" (s0),
    "fill_c" (the complex s0 + s1 i) or "arange" (s0 + i * s1); contiguous where ``ndim`` is None, else strided in
    ``ndim`` dimensions."""
    if fn not in _GENERATED:
        raise ValueError(f"no generated kernel {fn!r}")
    t = ctype(out_dtype)
    types = {t, *(ctype(d) for d in scalar_dtypes)}
    params = [f"GLOBAL {t}* o", "I64 oo"] + [f"{ctype(d)} s{k}" for k, d in enumerate(scalar_dtypes)]
    if fn == "fill_c":
        value = f"{t}_make(s0, s1)"
    elif fn == "fill":
        value = "s0"
    else:
        value = cast(scalar_dtypes[0], out_dtype, "(s0 + (" + ctype(scalar_dtypes[0]) + ")i * s1)")
    if ndim is None:
        params.append("I64 n")
        target, prologue, index = "o[oo + i]", "", ""
    else:
        params += ["GLOBAL const I64* meta", "I64 n"]
        prologue = "".join(f"  const I64 d{d} = meta[{d}];\n  const I64 t{d} = meta[{ndim + d}];\n"
                           for d in range(ndim))
        index = "    I64 r = i, p = oo;\n" + _walk("    ", "I64", "r", "d", ndim, [("p", "t")], widen="")
        target = "o[p]"
    body = _MAP.substitute(name=name, params=", ".join(params), prologue=prologue, index=index, target=target,
                           value=value)
    return source(types, body)


# -- the reduce family -----------------------------------------------------------------------------------------
def _extremes(dtype: np.dtype[Any]) -> tuple[str, str]:
    """C for the lowest and highest values of ``dtype`` (-inf and inf for floats; 0 for bool and complex)."""
    t = ctype(dtype)
    if dtype.kind == "f":
        return f"(({t})-GB_INF)", f"(({t})GB_INF)"
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        suffix = "ULL" if dtype.kind == "u" else "LL"
        lowest = f"(({t})({info.min}{suffix}))" if info.min != -(2**63) else f"(({t})(-{2**63 - 1}LL - 1))"
        return lowest, f"(({t})({info.max}{suffix}))"
    return f"(({t})0)", f"(({t})0)"


_UNROLL: Final = 4  # elements a reduction's work-item reads before it combines them


def _tree(half: int, pair: str) -> str:
    """C combining a work-group's shares (in work-group memory) pairwise, ``pair`` the statement that folds share
    ``LID + s`` into share ``LID``: a barrier after each step; on CUDA the last five steps run in the first warp
    alone, which synchronizes only itself (GB_WARP_TREE is 16 there, 0 in OpenCL, where a barrier inside a branch
    that not every work-item takes is undefined)."""
    out = f"    for (int s = {half}; s > GB_WARP_TREE; s >>= 1) {{\n      if (LID < s) {pair}\n      SYNC();\n    }}\n"
    out += "#ifndef __OPENCL_VERSION__\n"
    out += (f"    if (LID < 32) {{\n      for (int s = {min(half, 16)}; s > 0; s >>= 1) {{\n"
            f"        if (LID < s) {pair}\n        __syncwarp();\n      }}\n    }}\n")
    return out + "#endif\n"


def _accumulator(reduction: Reduction, out_dtype: np.dtype[Any], x_dtype: np.dtype[Any]) -> np.dtype[Any]:
    return {"out": out_dtype, "x": x_dtype, "bool": np.dtype(np.bool_),
            "int64": np.dtype(np.int64)}[reduction.accumulator]


def _names(acc_dtype: np.dtype[Any]) -> dict[str, str]:
    """What a reduction's expressions name of their accumulator's type (``_reductions``): {T}, {U}, {LOWEST},
    {HIGHEST}."""
    at = ctype(acc_dtype)
    lowest, highest = _extremes(acc_dtype)
    return {"T": at, "U": UNSIGNED.get(at, at), "LOWEST": lowest, "HIGHEST": highest}


# A finishing reduction's fence and ticket (in its source only, not the prelude every kernel shares): GB_FENCE()
# orders a work-item's device-memory writes before its later ones, as other work-groups see them; GB_TICKET(p) adds
# 1 to the U32 at p atomically and gives its value before.
_TICKETS: Final = """#ifdef __OPENCL_VERSION__
#define GB_FENCE() mem_fence(CLK_GLOBAL_MEM_FENCE)
#define GB_TICKET(p) atomic_inc((volatile GLOBAL U32*)(p))
#else
#define GB_FENCE() __threadfence()
#define GB_TICKET(p) atomicAdd((U32*)(p), 1u)
#endif
"""


# The 16-byte loads of a reduction's contiguous 4-byte elements: OpenCL's vload4 takes any element-aligned address;
# CUDA's vector types need 16-byte alignment, so there the loop takes them only from an aligned start.
_LOADS4: Final = """#ifdef __OPENCL_VERSION__
#define GB_ALIGNED16(p) 1
#define GB_LOAD4(V, p, k) vload4((k), (p))
#else
#define GB_ALIGNED16(p) ((((unsigned long long)(p)) & 15) == 0)
#define GB_LOAD4(V, p, k) (reinterpret_cast<const V*>(p)[k])
#endif
"""
_VECTOR4: Final = {"F32": "float4", "I32": "int4", "U32": "uint4"}  # (the same names in both dialects)


def _vector(xt: str, at: str, load: str, step: str, block: int) -> str:
    """C reading the quadruples of a work-group's contiguous 4-byte elements [j0, j1) 16 bytes at a time, each
    work-item four quadruples in flight, combining each element as the scalar loop would; then the scalar loops go
    on with what is left (fewer than 4 elements). Measured on an H200: a row sum of 8192 x 4096 float32 took 36-37
    us with 4-byte loads, 33 us with these, as CuPy's."""
    v4 = _VECTOR4[xt]

    def combine(q: str) -> str:
        return "".join(f"        {{ const {at} v = {load.replace('x[xp]', f'{q}.{c}')}; acc = {step}; }}\n"
                       for c in "xyzw")

    return (f"    if (GB_ALIGNED16(x + xb + j0)) {{\n"
            f"      const GLOBAL {xt}* xr = x + xb + j0;\n"
            "      const I64 n4 = (j1 - j0) >> 2;\n"
            "      I64 k = LID;\n"
            f"      for (; k + {3 * block} < n4; k += {4 * block}) {{\n"
            + "".join(f"        const {v4} q{u} = GB_LOAD4({v4}, xr, k + {u * block});\n" for u in range(4))
            + "".join(combine(f"q{u}") for u in range(4))
            + "      }\n"
            f"      for (; k < n4; k += {block}) {{\n        const {v4} q0 = GB_LOAD4({v4}, xr, k);\n"
            + combine("q0") + "      }\n"
            "      jn = j0 + 4 * n4 + LID;\n"
            "    }\n")


def _finish(fn: str, out_dtype: np.dtype[Any], block: int) -> tuple[str, str, str]:
    """(work-group memory, C, its types) of a split reduction's finish: after each part's value is written, its
    work-group takes a ticket of its output's (in ``cnt``, zero between launches); the last one reads the parts'
    values and combines them with the reduction ``partials`` names, as a second pass would (one work-group per
    output, a tree), writes the output (``fo``, contiguous: output ``go`` at ``foo + go``) and sets the ticket back
    to zero. The fences order each part's value before its ticket, and the last one's reads after it."""
    second = REDUCTIONS[REDUCTIONS[fn].partials or fn]
    acc = _accumulator(second, out_dtype, out_dtype)
    at, kind = ctype(acc), acc.kind
    names = _names(acc)
    combine = second.reduce[kind]
    step = combine.format(a="acc2", b=second.map, **names)
    pair = "sf[LID] = " + combine.format(a="sf[LID]", b="sf[LID + s]", **names) + ";"
    load = cast(out_dtype, acc, "o[pb + p * pstep]")
    code = (
        "    GB_FENCE();\n"
        "    if (LID == 0) gb_last = GB_TICKET(cnt + go) == (U32)(parts - 1);\n"
        "    SYNC();\n"
        "    if (gb_last) {\n"
        "      GB_FENCE();\n"
        "      const I64 pb = ob - gp * pstep;\n"
        f"      {at} acc2 = {second.identity[kind].format(**names)};\n"
        f"      for (I64 p = LID; p < parts; p += {block}) {{ const {at} v = {load}; acc2 = {step}; }}\n"
        "      sf[LID] = acc2; SYNC();\n"
        + _tree(block // 2, pair)
        + f"      if (LID == 0) {{ fo[foo + go] = {cast(acc, out_dtype, second.post_map.format(a='sf[0]'))}; "
        "cnt[go] = 0; }\n"
        "    }\n"
        "    SYNC();\n")
    return f"  SHARED {at} sf[{block}];\n  SHARED int gb_last;\n", code, at


def reduce_source(name: str, fn: str, out_dtype: np.dtype[Any], x_dtype: np.dtype[Any],
                  center_dtype: np.dtype[Any] | None, variant: tuple[int, int, bool, int, bool, bool]) -> str:
    """The kernel ``name`` of the reduction ``fn`` (``_reductions``) of x (``x_dtype``) into ``out_dtype``, with a
    center of ``center_dtype`` where it takes one. ``variant``: (kept dimensions, reduced dimensions, whether
    indices fit 32 bits, the work-group size, whether the reduced elements are contiguous: element j at x's
    base + j, with no shape or strides to walk, whether a split reduction finishes in the same launch:
    ``_finish``)."""
    reduction = REDUCTIONS[fn]
    kd, rd, small, block, contiguous, finish = variant
    idx = "U32" if small else "I64"
    ot, xt = ctype(out_dtype), ctype(x_dtype)
    acc_dtype = _accumulator(reduction, out_dtype, x_dtype)
    at = ctype(acc_dtype)
    types = {ot, xt, at, "I64"} | ({ctype(center_dtype)} if center_dtype is not None else set())
    finish_shared = finish_code = ""
    if finish:
        finish_shared, finish_code, finish_type = _finish(fn, out_dtype, block)
        types.add(finish_type)
    kind = acc_dtype.kind
    names = _names(acc_dtype)
    identity = reduction.identity[kind].format(**names)
    arg = reduction.better is not None
    helpers = ""
    if arg:
        helpers = _REDUCE_ARG_BETTER.substitute(A=at, better=reduction.better,
                                                nan_first=_NAN_FIRST if kind == "f" else "")
    params = [f"GLOBAL {ot}* o", "I64 oo", f"GLOBAL const {xt}* x", "I64 xo"]
    if center_dtype is not None:
        params += [f"GLOBAL const {ctype(center_dtype)}* cen", "I64 co"]
    params += ["GLOBAL const I64* meta", "I64 nout", "I64 m", "I64 parts", "I64 chunk", "I64 pstep"]
    if finish:
        params += [f"GLOBAL {ot}* fo", "I64 foo", "GLOBAL U32* cnt"]
    nk = 3 if center_dtype is not None else 2  # the kept dimensions' operands: x, the output (, the center)
    prologue = _read_meta(idx, "kd", "kt", 0, kd, nk)
    base = kd + nk * kd
    prologue += "".join(f"  const {idx} rd{d} = ({idx})meta[{base + d}];\n" for d in range(rd))
    prologue += "".join(f"  const I64 rt{d} = meta[{base + rd + d}];\n" for d in range(rd))
    bases = ("xb", "ob", "cb")[:nk]
    locate = _walk("    ", idx, "r", "kd", kd, [(target, f"kt{p}_") for p, target in enumerate(bases)])

    def walk_at(indent: str) -> str:
        """C finding element j's position xp (x's base + j where the reduced elements are contiguous)."""
        if contiguous:
            return f"{indent}const I64 xp = xb + j;\n"
        return f"{indent}{idx} q = ({idx})j;\n{indent}I64 xp = xb;\n" + _walk(indent, idx, "q", "rd", rd,
                                                                              [("xp", "rt")])

    walk = walk_at("      ")
    if reduction.read == "nonzero":
        load = f"(I64){cast(x_dtype, np.dtype(np.bool_), 'x[xp]')}"
    else:
        load = cast(x_dtype, acc_dtype, "x[xp]")
    unrolled = range(_UNROLL)
    loads = f"      {at} " + ", ".join(f"v{u}" for u in unrolled) + ";\n" + "".join(
        f"      {{ const I64 j = jn + {u * block};\n{walk_at('        ')}        v{u} = {load}; }}\n"
        for u in unrolled)
    last, stride = (_UNROLL - 1) * block, _UNROLL * block
    if arg:
        steps = "".join(f"      if (gb_better(v{u}, jn + {u * block}, acc, ai)) "
                        f"{{ acc = v{u}; ai = jn + {u * block}; }}\n" for u in unrolled)
        pair = ("if (gb_better(sv[LID + s], si[LID + s], sv[LID], si[LID])) "
                "{ sv[LID] = sv[LID + s]; si[LID] = si[LID + s]; }")
        loop = _REDUCE_ARG.substitute(A=at, identity=identity, block=block, walk=walk, load=load,
                                      last=last, stride=stride, unrolled_loads=loads, unrolled_steps=steps,
                                      tree=_tree(block // 2, pair), post=cast(np.dtype(np.int64), out_dtype, "si[0]"))
    else:
        combine = reduction.reduce[kind]
        center = (f"    const {at} cv = {cast(center_dtype, acc_dtype, 'cen[cb]')};\n"
                  if center_dtype is not None else "")
        step = combine.format(a="acc", b=reduction.map, **names)
        steps = "".join(f"      {{ const {at} v = v{u}; acc = {step}; }}\n" for u in unrolled)
        pair = "sv[LID] = " + combine.format(a="sv[LID]", b="sv[LID + s]", **names) + ";"
        vector = ""
        if contiguous and xt in _VECTOR4:
            vector = _vector(xt, at, load, step, block)
            helpers = _LOADS4 + helpers
        loop = _REDUCE_VALUE.substitute(
            center=center, A=at, identity=identity, block=block, walk=walk, load=load, step=step, vector=vector,
            last=last, stride=stride, unrolled_loads=loads, unrolled_steps=steps, tree=_tree(block // 2, pair),
            post=cast(acc_dtype, out_dtype, reduction.post_map.format(a="sv[0]")))
    if finish:
        helpers = _TICKETS + helpers
    body = _REDUCE.substitute(helpers=helpers, name=name, params=", ".join(params), A=at, block=block,
                              shared_index=f"  SHARED I64 si[{block}];\n" if arg else "", prologue=prologue,
                              idx=idx, center_base=", cb = co" if nk == 3 else "", locate=locate, loop=loop,
                              finish_shared=finish_shared, finish=finish_code)
    return source(types, body)
