"""The torch device's operator allowlist: the ATen overloads a tenant's worker runs, shared by client and worker.

A name is an overload as ``gpubroker.wire.torch`` sends it: ``"aten::add.Tensor"``, ``"aten::mm.default"``
(``f"{op._schema.name}.{op._overloadname}"``). The client refuses any other operator before sending it
(``NotImplementedError`` naming it); the worker refuses it again (``Unimplemented``), since it trusts no client.

What is listed computes on tensors and nothing else. Left out on purpose: whatever reads or writes files
(``from_file``, ``save``/``load``), loads code or libraries, changes process-wide state (``set_num_threads``,
deterministic or cuDNN flags, allocator settings, cuFFT plan cache sizes), reaches another process, skips
PyTorch's bounds checks (``_unsafe_index``, ``_index_put_impl_``'s ``unsafe``), or changes a tensor's storage
behind the quota's back (``resize_``, ``set_``, ``out=`` overloads, which resize their outputs): the worker
charges each new output's storage against the tenant's memory quota, and those would grow one it already charged.
Every listed forward operator's backward operators are listed too: a refusal inside ``backward`` can only be
deferred.

``SYNC`` are the listed operators whose output shapes depend on the data, or that return a plain value: the
client sends them as ``TorchOpSync`` and waits for what came out.
"""

from __future__ import annotations

from typing import Final

__all__ = ["ALLOWED", "SYNC", "allowed", "split_name"]


def _each(overloads: str, names: str) -> set[str]:
    """``aten::<name>.<overload>`` for every name and overload (whitespace-separated)."""
    return {f"aten::{name}.{overload}" for name in names.split() for overload in overloads.split()}


def _inplace(overloads: str, names: str) -> set[str]:
    """Each name's functional and in-place (``name_``) forms, with each overload."""
    return _each(overloads, names) | _each(overloads, " ".join(f"{n}_" for n in names.split()))


def _listed(text: str) -> set[str]:
    """Names written out in full (``name.overload``), whitespace-separated."""
    return {f"aten::{name}" for name in text.split()}


# Pointwise, one tensor in: functional and in-place.
_UNARY = _inplace("default", """
    abs neg sign sgn reciprocal sqrt rsqrt exp exp2 expm1 log log2 log10 log1p sin cos tan asin acos atan sinh cosh
    tanh asinh acosh atanh sigmoid relu erf erfc erfinv floor ceil round trunc frac square bitwise_not logical_not
    lgamma digamma i0 sinc deg2rad rad2deg logit nan_to_num positive conj_physical angle
""") | _listed("""
    round.decimals round_.decimals isnan.default isinf.default isfinite.default isneginf.default isposinf.default
    signbit.default real.default imag.default conj.default _conj.default resolve_conj.default resolve_neg.default
    view_as_real.default view_as_complex.default
""")
# Pointwise, two operands (tensor and tensor, or tensor and a number).
_BINARY = _inplace("Tensor Scalar", """
    add sub mul div remainder fmod pow eq ne lt le gt ge bitwise_and bitwise_or bitwise_xor bitwise_left_shift
    bitwise_right_shift
""") | _inplace("default", """
    atan2 maximum minimum fmax fmin hypot copysign logical_and logical_or logical_xor xlogy nextafter
""") | _listed("""
    div.Tensor_mode div_.Tensor_mode div.Scalar_mode div_.Scalar_mode pow.Tensor_Tensor pow_.Tensor
    pow.Tensor_Scalar pow_.Scalar pow.Scalar rsub.Tensor rsub.Scalar xlogy.Tensor xlogy_.Tensor xlogy.Scalar_Self
    xlogy.Scalar_Other xlogy_.Scalar_Other remainder.Scalar_Tensor floor_divide.Scalar floor_divide_.Scalar
    copysign.Scalar copysign_.Scalar floor_divide.default floor_divide_.Tensor
    clamp.default clamp_.default clamp.Tensor clamp_.Tensor clamp_min.default
    clamp_min_.default clamp_min.Tensor clamp_min_.Tensor clamp_max.default clamp_max_.default clamp_max.Tensor
    clamp_max_.Tensor lerp.Scalar lerp_.Scalar lerp.Tensor lerp_.Tensor addcmul.default addcmul_.default
    addcdiv.default addcdiv_.default where.self where.ScalarOther where.ScalarSelf where.Scalar
    masked_fill.Scalar masked_fill_.Scalar masked_fill.Tensor masked_fill_.Tensor isclose.default
    heaviside.default heaviside_.default
""")
# Activations and their backward operators.
_ACTIVATIONS = _listed("""
    threshold.default threshold_.default threshold_backward.default gelu.default gelu_.default gelu_backward.default
    silu.default silu_.default silu_backward.default mish.default mish_.default mish_backward.default
    hardtanh.default hardtanh_.default hardtanh_backward.default hardsigmoid.default hardsigmoid_.default
    hardsigmoid_backward.default hardswish.default hardswish_.default hardswish_backward.default
    leaky_relu.default leaky_relu_.default leaky_relu_backward.default elu.default elu_.default elu_backward.default
    softplus.default softplus_backward.default sigmoid_backward.default tanh_backward.default
    logit_backward.default relu6.default prelu.default _prelu_kernel.default _prelu_kernel_backward.default
    glu.default glu_backward.default log_sigmoid_forward.default log_sigmoid_backward.default
    hardshrink.default hardshrink_backward.default softshrink.default softshrink_backward.default
    rrelu_with_noise.default rrelu_with_noise_backward.default celu.default celu_.default selu.default selu_.default
""")
# Reductions, scans, sorting.
_REDUCTIONS = _listed("""
    sum.default sum.dim_IntList mean.default mean.dim prod.default prod.dim_int nansum.default nanmean.default
    amax.default amin.default aminmax.default max.default max.dim min.default min.dim argmax.default
    argmin.default all.default all.dim all.dims any.default any.dim any.dims std.correction var.correction
    std_mean.correction var_mean.correction logsumexp.default norm.Scalar norm.ScalarOpt_dim
    linalg_vector_norm.default count_nonzero.default count_nonzero.dim_IntList cumsum.default cumsum_.default
    cumprod.default cumprod_.default cummax.default cummin.default _cummax_helper.default _cummin_helper.default
    logcumsumexp.default _logcumsumexp.default sort.default sort.stable argsort.default argsort.stable
    topk.default kthvalue.default median.default median.dim nanmedian.default nanmedian.dim mode.default
    cumprod_backward.default
""")
# Matrix products, and a few linear algebra operators that have no data-dependent output shape.
_LINALG = _listed("""
    mm.default bmm.default addmm.default addmm_.default addbmm.default baddbmm.default baddbmm_.default
    addmv.default addr.default mv.default dot.default vdot.default matmul.default linear.default
    _addmm_activation.default outer.default ger.default einsum.default tensordot.default kron.default
    trace.default trace_backward.default tril.default tril_.default triu.default triu_.default diag.default
    diag_embed.default diagonal_backward.default cross.default linalg_cross.default cdist.default
    _cdist_forward.default _cdist_backward.default _euclidean_dist.default
""")
# Convolution, pooling, normalization, upsampling, dropout, embedding.
_NN = _listed("""
    convolution.default convolution_backward.default _convolution.default
    conv1d.default conv2d.default conv3d.default conv_transpose1d.default conv_transpose2d.input
    max_pool2d_with_indices.default max_pool2d_with_indices_backward.default max_pool3d_with_indices.default
    max_pool3d_with_indices_backward.default avg_pool2d.default avg_pool2d_backward.default avg_pool3d.default
    avg_pool3d_backward.default _adaptive_avg_pool2d.default _adaptive_avg_pool2d_backward.default
    _adaptive_avg_pool3d.default _adaptive_avg_pool3d_backward.default adaptive_max_pool2d.default
    adaptive_max_pool2d_backward.default max_unpool2d.default
    native_batch_norm.default native_batch_norm_backward.default _native_batch_norm_legit.default
    _native_batch_norm_legit.no_stats _native_batch_norm_legit_functional.default
    _native_batch_norm_legit_no_training.default batch_norm_backward.default
    native_layer_norm.default native_layer_norm_backward.default native_group_norm.default
    native_group_norm_backward.default _fused_rms_norm.default _fused_rms_norm_backward.default
    upsample_nearest1d.default upsample_nearest2d.default upsample_nearest2d_backward.default
    upsample_nearest3d.default upsample_bilinear2d.default upsample_bilinear2d_backward.default
    upsample_bicubic2d.default upsample_linear1d.default _upsample_nearest_exact2d.default
    _upsample_bilinear2d_aa.default grid_sampler_2d.default grid_sampler_2d_backward.default
    native_dropout.default native_dropout_backward.default
    embedding.default embedding_dense_backward.default _embedding_bag.default _embedding_bag_backward.default
    _embedding_bag_dense_backward.default _embedding_bag_per_sample_weights_backward.default
    pixel_shuffle.default pixel_unshuffle.default im2col.default col2im.default
    reflection_pad1d.default reflection_pad2d.default reflection_pad1d_backward.default
    reflection_pad2d_backward.default replication_pad1d.default replication_pad2d.default
    replication_pad1d_backward.default replication_pad2d_backward.default constant_pad_nd.default
    _softmax.default _softmax_backward_data.default _log_softmax.default _log_softmax_backward_data.default
    _safe_softmax.default
    _scaled_dot_product_attention_math.default _scaled_dot_product_flash_attention.default
    _scaled_dot_product_flash_attention_backward.default _scaled_dot_product_efficient_attention.default
    _scaled_dot_product_efficient_attention_backward.default _scaled_dot_product_cudnn_attention.default
    _scaled_dot_product_cudnn_attention_backward.default _scaled_dot_product_flash_attention_for_cpu.default
    _scaled_dot_product_flash_attention_for_cpu_backward.default _fused_sdp_choice.default
""")
# Losses and their backward operators.
_LOSSES = _listed("""
    nll_loss_forward.default nll_loss_backward.default nll_loss2d_forward.default nll_loss2d_backward.default
    mse_loss.default mse_loss_backward.default l1_loss.default smooth_l1_loss.default
    smooth_l1_loss_backward.default huber_loss.default huber_loss_backward.default
    binary_cross_entropy.default binary_cross_entropy_backward.default binary_cross_entropy_with_logits.default
    soft_margin_loss.default soft_margin_loss_backward.default multi_margin_loss.default
    multi_margin_loss_backward.default multilabel_margin_loss_forward.default
    multilabel_margin_loss_backward.default kl_div.default _ctc_loss.default _ctc_loss.Tensor
    _ctc_loss_backward.default _ctc_loss_backward.Tensor
""")
# Views and reshapes (the worker runs the real view operator, so a view shares its base's storage there too).
_VIEWS = _listed("""
    view.default view.dtype _unsafe_view.default reshape.default _reshape_alias.default as_strided.default
    expand.default expand_as.default permute.default t.default transpose.int numpy_T.default mT.default mH.default
    adjoint.default squeeze.default squeeze.dim squeeze.dims unsqueeze.default select.int slice.Tensor
    narrow.default diagonal.default unfold.default unbind.int split.Tensor split_with_sizes.default
    tensor_split.sections tensor_split.indices chunk.default alias.default detach.default lift_fresh.default
    movedim.int movedim.intlist flatten.using_ints unflatten.int view_as.default contiguous.default
    t_.default transpose_.default squeeze_.default squeeze_.dim squeeze_.dims unsqueeze_.default
    as_strided_.default detach_.default
    select_backward.default slice_backward.default unfold_backward.default as_strided_scatter.default
    select_scatter.default slice_scatter.default diagonal_scatter.default
    view_copy.default permute_copy.default t_copy.default transpose_copy.int expand_copy.default
    squeeze_copy.dim unsqueeze_copy.default select_copy.int slice_copy.Tensor diagonal_copy.default
    alias_copy.default detach_copy.default unbind_copy.int split_copy.Tensor split_with_sizes_copy.default
    as_strided_copy.default _unsafe_view.default
""")
# Copies, fills, creation, conversion, joining, reordering.
_CREATE = _listed("""
    clone.default copy_.default _to_copy.default to.dtype to.dtype_layout _copy_from.default
    fill_.Scalar fill_.Tensor fill.Scalar fill.Tensor zero_.default zero.default
    empty.memory_format empty_strided.default empty_like.default new_empty.default new_empty_strided.default
    zeros.default zeros_like.default new_zeros.default ones.default ones_like.default new_ones.default
    full.default full_like.default new_full.default scalar_tensor.default arange.default arange.start
    arange.start_step linspace.default logspace.default eye.default eye.m tril_indices.default
    triu_indices.default
    cat.default stack.default hstack.default vstack.default dstack.default column_stack.default
    flip.default fliplr.default flipud.default roll.default rot90.default repeat.default tile.default
    repeat_interleave.self_int _pad_packed_sequence.default
    index.Tensor index_put.default index_put_.default index_select.default index_select_backward.default
    index_add.default index_add_.default index_copy.default index_copy_.default index_fill.int_Scalar
    index_fill_.int_Scalar
    index_fill.int_Tensor index_fill_.int_Tensor index_reduce.default index_reduce_.default
    gather.default gather_backward.default scatter.src scatter_.src scatter.value scatter_.value scatter.reduce
    scatter_.reduce scatter.value_reduce scatter_.value_reduce scatter_add.default scatter_add_.default
    scatter_reduce.two scatter_reduce_.two take.default take_along_dim.default put.default put_.default
    masked_scatter.default masked_scatter_.default masked_scatter_backward.default bucketize.Tensor
    bucketize.Scalar searchsorted.Tensor searchsorted.Scalar histc.default bincount.default
    one_hot.default _assert_async.default _assert_async.msg
""")
# Random numbers, from the worker's generator for its device (seeded by TorchSeed).
_RANDOM = _listed("""
    normal_.default normal.Tensor_float normal.float_Tensor normal.Tensor_Tensor normal.float_float
    uniform_.default bernoulli.default bernoulli_.float bernoulli_.Tensor bernoulli.p random_.default
    random_.from random_.to exponential_.default geometric_.default log_normal_.default cauchy_.default
    rand.default rand_like.default randn.default randn_like.default randint.default randint.low
    randint_like.default randint_like.low_dtype randperm.default multinomial.default poisson.default
    native_dropout.default
""")
# The optimizers' multi-tensor (foreach) and fused paths (SGD, Adam, AdamW, and clip_grad_norm_).
_FOREACH = _each("List Scalar ScalarList Tensor", """
    _foreach_add _foreach_add_ _foreach_sub _foreach_sub_ _foreach_mul _foreach_mul_ _foreach_div _foreach_div_
    _foreach_maximum _foreach_maximum_ _foreach_minimum _foreach_minimum_ _foreach_pow _foreach_pow_
    _foreach_clamp_min _foreach_clamp_min_ _foreach_clamp_max _foreach_clamp_max_
""") | _inplace("default", """
    _foreach_sqrt _foreach_neg _foreach_abs _foreach_exp _foreach_log _foreach_reciprocal _foreach_sign
    _foreach_zero _foreach_sigmoid _foreach_tanh _foreach_lerp _foreach_addcmul _foreach_addcdiv _foreach_copy
""") | _each("Scalar ScalarList Tensor List", "_foreach_lerp _foreach_lerp_ _foreach_addcmul _foreach_addcmul_"
             " _foreach_addcdiv _foreach_addcdiv_") | _listed("""
    _foreach_norm.Scalar _foreach_max.default _foreach_pow.ScalarAndTensor _foreach_copy_.default
    _fused_adam_.default _fused_adam_.tensor_lr _fused_adamw_.default _fused_adamw_.tensor_lr
    _fused_sgd_.default _fused_sgd_.tensor_lr _fused_adagrad_.default
""")
# Operators that need the data on the host: their outputs' shapes depend on it, or they return a value.
_SYNC = _listed("""
    _local_scalar_dense.default equal.default is_nonzero.default is_same_size.default nonzero.default
    nonzero_static.default argwhere.default masked_select.default masked_select_backward.default
    _unique.default _unique2.default unique_dim.default unique_consecutive.default unique_dim_consecutive.default
    repeat_interleave.Tensor repeat_interleave.self_Tensor allclose.default
""")

# The helpers above make every combination of name and overload; these are not ATen's (tests/broker/backends/
# test_torch_session.py checks that every listed name is an operator of the installed PyTorch).
_NOT_OPERATORS = _listed("""
    _foreach_addcdiv.List _foreach_addcdiv.default _foreach_addcdiv_.List _foreach_addcdiv_.default
    _foreach_addcmul.List _foreach_addcmul.default _foreach_addcmul_.List _foreach_addcmul_.default
    _foreach_clamp_max.Tensor _foreach_clamp_max_.Tensor _foreach_clamp_min.Tensor _foreach_clamp_min_.Tensor
    _foreach_lerp.Tensor _foreach_lerp.default _foreach_lerp_.Tensor _foreach_lerp_.default
    _foreach_maximum.Tensor _foreach_maximum_.Tensor _foreach_minimum.Tensor _foreach_minimum_.Tensor
    _foreach_pow.Tensor _foreach_pow_.Tensor _foreach_sub.Tensor _foreach_sub_.Tensor angle_.default
    bitwise_left_shift.Scalar bitwise_left_shift_.Scalar bitwise_right_shift.Scalar bitwise_right_shift_.Scalar
    copysign_.default floor_divide.Tensor fmax_.default fmin_.default maximum_.default minimum_.default
    positive_.default pow.Tensor xlogy.default xlogy_.default
""")

SYNC: Final[frozenset[str]] = frozenset(_SYNC)
ALLOWED: Final[frozenset[str]] = frozenset(
    (_UNARY | _BINARY | _ACTIVATIONS | _REDUCTIONS | _LINALG | _NN | _LOSSES | _VIEWS | _CREATE | _RANDOM | _FOREACH
     | _SYNC) - _NOT_OPERATORS)


def allowed(name: str) -> bool:
    """Whether the operator overload ``name`` ("aten::add.Tensor") is on the allowlist."""
    return name in ALLOWED


def split_name(name: str) -> tuple[str, str, str]:
    """``"aten::add.Tensor"`` -> ("aten", "add", "Tensor"); ValueError for a name of another form."""
    namespace, sep, rest = name.partition("::")
    op, dot, overload = rest.partition(".")
    if not sep or not dot or not namespace or not op or not overload or "." in overload:
        raise ValueError(f"an operator overload is 'namespace::name.overload', got {name!r:.140}")
    return namespace, op, overload
