"""Low-bit weight GEMMs (W4A16, W8A16, W8A8, W4A8) in Triton, each beside its torch twin.

    y = linear(x, pw, config)        x [M, K] bf16/fp16 -> y [M, N] in x's dtype
    y = linear_twin(x, pw)           the same function in plain torch (dequantize, then matmul in fp32)

`pw` is a PackedWeight: the weight as the kernels read it, repacked once from QuantLinear's codes
(`pack_weight`) and recorded in `pw.layout`:
    bits 4:          qweight int32 [N, K/8], nibble i of word j = q[n, 8j + i] + 8 -- compressed-tensors'
                     own pack_to_int32 layout, so a pack-quantized checkpoint's words are used as they are
    bits 8:          qweight int8 [N, K], q signed (one byte per weight)
    scale            [G, N] (transposed: a K-tile reads one contiguous row), the checkpoint's dtype
    zero             int8 [G, N] or None (symmetric)
The weight is w[n, k] = (q[n, k] - zero[g, n]) * scale[g, n], g = k // group, as grid.dequantize_on.

Kernel math (why it is exact up to the accumulation order against the twin):
- A16: q - zero is an integer in [-255, 255], exact in bf16 (8 significant bits hold |v| <= 256), so the
  tensor cores multiply x by the exact integer weight; the group's scale multiplies the fp32 partial
  sum of each K-tile (a tile never straddles a group: BK divides the group). Per-channel weights
  scale once at the end. Nibbles become floats without an int->float convert: (v | 0x4B000000)
  read as fp32 is 2**23 + v.
- A8: activations are quantized per token inside the kernel's prologue (FUSED_AQ: a first pass over
  the row block's K finds amax; the main loop quantizes each tile as it loads it), then int8 x int8 ->
  int32 on the tensor cores; per-channel scales (W8A8) in the epilogue, group scales (W4A8) per K-tile.
  The quantization is the one quantizer's (lowbit.weights.act_quant, compressed-tensors' arithmetic),
  bit for bit: s = amax / 127.5 and q = x / s are computed as torch computes them in x's dtype -- an
  IEEE fp32 quotient (div_rn) rounded half-even to bf16/fp16 (`_round_act`) -- s = eps(x's dtype) for
  an all-zero row, then clamp to [-128, 127] and round half to even.
Split-K (SPLIT_K > 1) accumulates fp32 partials with atomics into a zeroed fp32 buffer.

Shapes are any M >= 1, N >= 1; K must be a multiple of 16 and of the group (the scheme checks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.weights.act_quant import A8_DIV, A8_QMAX, A8_QMIN, act_eps, quantize_activations_per_token
from lowbit.weights.scheme import parse_weight_scheme

try:
    import triton
    import triton.language as tl
except ImportError:  # a plan can be printed without Triton; the kernels need it
    triton = None

MAGIC_F = 8388608.0  # 2**23: (v | 0x4B000000) as float32 == 2**23 + v for 0 <= v < 2**23
RNE_F = 12582912.0  # 1.5 * 2**23: (v + RNE) - RNE rounds fp32 |v| < 2**22 half-to-even
_ACT_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernels' ADT constexpr


def _adt(dtype: torch.dtype) -> int:
    """The activation dtype as the kernels' ADT code (0 fp32, 1 bf16, 2 fp16)."""
    if dtype not in _ACT_DTYPES:
        raise ValueError(f"A8 kernels take fp32/bf16/fp16 activations, got {dtype}")
    return _ACT_DTYPES[dtype]


@dataclass
class PackedWeight:
    """A quantized weight in the kernels' layout (see module docstring).

    N, K:      out_features, in_features
    bits:      4 or 8;  group: K-group size (== K for per-channel);  a_bits: 16 or 8
    qweight:   int32 [N, K/8] (bits 4) or int8 [N, K] (bits 8)
    scale:     [G, N];  zero: int8 [G, N] or None;  bias: [N] or None
    """

    N: int
    K: int
    bits: int
    group: int
    a_bits: int
    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    layout: str = field(default="")

    @property
    def kind(self) -> str:
        """The dispatch key: w4a16 | w8a16 | w8a8 | w4a8."""
        return f"w{self.bits}a{self.a_bits}"

    @property
    def per_channel(self) -> bool:
        return self.group == self.K

    def nbytes(self) -> int:
        """Bytes held on the device (codes + scales + zero-points + bias)."""
        ts = [self.qweight, self.scale, self.zero, self.bias]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def pack_int4_k(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8/int [N, K] in [0, 16) -> int32 [N, K/8]; code k sits in bits 4*(k % 8) of word k // 8.

    The same words as compressed-tensors' pack_to_int32 (tested equal); written here because the GPU image
    has no compressed-tensors and the kernels must not need it at run time."""
    N, K = codes.shape
    if K % 8:
        raise ValueError(f"K={K} is not a multiple of 8")
    c = codes.to(torch.int64).reshape(N, K // 8, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    v = (c << shifts).sum(dim=-1)  # [N, K/8] in [0, 2**32)
    return (v - ((v >> 31) & 1) * 2**32).to(torch.int32)  # the same 32 bits as a signed int32


def unpack_int4_k(words: torch.Tensor, K: int) -> torch.Tensor:
    """int32 [N, K/8] -> codes uint8 [N, K]; the inverse of pack_int4_k."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).reshape(words.shape[0], K).to(torch.uint8)


def pack_weight(codes: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None, *, bits: int,
                group: int, a_bits: int, bias: torch.Tensor | None = None) -> PackedWeight:
    """PackedWeight from QuantLinear's buffers: codes uint8 [N, K] (c = q + 2**(bits-1)), scale [N, G],
    zero_point int8 [N, G] (None or all zero: symmetric)."""
    N, K = codes.shape
    if bits == 4:
        qw, layout = pack_int4_k(codes), "int4 k-packed int32 [N, K/8] (compressed-tensors order), q + 8"
    elif bits == 8:
        qw, layout = (codes.to(torch.int16) - 128).to(torch.int8).contiguous(), "int8 [N, K], q signed"
    else:
        raise ValueError(f"weight kernels take 4- or 8-bit weights, got {bits}")
    zp = None
    if zero_point is not None and bool((zero_point != 0).any()):
        zp = zero_point.to(torch.int8).t().contiguous()
    return PackedWeight(N, K, bits, group, a_bits, qw, scale.t().contiguous(), zp,
                        None if bias is None else bias.detach().clone(), layout + f", scale [G, N] {scale.dtype}")


def dequantize(pw: PackedWeight) -> torch.Tensor:
    """float32 [N, K]: the weight the kernels compute with (torch, for twins and the fallback)."""
    if pw.bits == 4:
        q = unpack_int4_k(pw.qweight, pw.K).to(torch.float32) - 8.0
    else:
        q = pw.qweight.to(torch.float32)
    G = pw.K // pw.group
    s = pw.scale.t().float()  # [N, G]
    if pw.zero is not None:
        q = q - pw.zero.t().float().repeat_interleave(pw.group, dim=1)
    return q * s.repeat_interleave(pw.group, dim=1) if G > 1 else q * s


def linear_twin(x: torch.Tensor, pw: PackedWeight, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch twin: x [M, K] -> [M, N] in x's dtype, computed in fp32 from the dequantized weight
    (A8: from the per-token int8 activations, exactly as QuantLinear's CPU forward)."""
    if pw.a_bits == 8:
        xq, sx = quantize_activations_per_token(x)
        xf = xq.float() * sx
    else:
        xf = x.float()
    y = xf @ dequantize(pw).t()
    if pw.bias is not None:
        y = y + pw.bias.float()
    return y.to(out_dtype or x.dtype)


@dataclass(frozen=True)
class GemmConfig:
    """Launch configuration of `linear`'s Triton kernel.

    BM/BN/BK: tile; SPLIT_K: K-splits (fp32 atomics); GROUP_M: row-block swizzle for L2 reuse;
    unpack: 'gather' (each lane loads the word holding its nibble), 'reshape' (load words, split
    in registers) or 'pairs' (4-bit A16 bf16 on CUDA: two nibbles to two bf16 in one lop3 + one
    bf16x2 subtract, the K order permuted consistently in x and w) or 'split' (4-bit A16: eight dots
    of K = BK/8 per tile, one per nibble position, x read at stride 8; BK >= 128); fused_aq: A8 activation quantization inside the kernel (else a separate kernel).
    swap (A16 only): y^T = W x^T, the weight tile the dot's first operand (BN rows as its M side, BM >= 16
    activation rows as its N side): at small M a 64-row weight tile fills a Hopper wgmma's M where BM = 16
    activation rows cannot, and the dequantized tile is the operand that may stay in registers."""

    BM: int = 16
    BN: int = 64
    BK: int = 128
    SPLIT_K: int = 1
    GROUP_M: int = 8
    num_warps: int = 4
    num_stages: int = 3
    unpack: str = "gather"
    fused_aq: bool = True
    swap: bool = False
    tma: bool = False  # W8A8 per-channel only: both int8 operands through TMA descriptors (_w8a8_tma_kernel)

    @classmethod
    def from_name(cls, name: str) -> GemmConfig:
        """Inverse of `name` (the dispatch tables store names)."""
        import re

        m = re.fullmatch(r"bm(\d+)-bn(\d+)-bk(\d+)-sk(\d+)-w(\d+)-s(\d+)(-rs|-pr|-sp)?(-aq2)?(-sw)?(-tma)?", name)
        if m is None:
            raise ValueError(f"not a GemmConfig name: {name!r}")
        unpack = {None: "gather", "-rs": "reshape", "-pr": "pairs", "-sp": "split"}[m[7]]
        return cls(BM=int(m[1]), BN=int(m[2]), BK=int(m[3]), SPLIT_K=int(m[4]), num_warps=int(m[5]),
                   num_stages=int(m[6]), unpack=unpack, fused_aq=m[8] is None, swap=m[9] is not None,
                   tma=m[10] is not None)

    @property
    def name(self) -> str:
        s = f"bm{self.BM}-bn{self.BN}-bk{self.BK}-sk{self.SPLIT_K}-w{self.num_warps}-s{self.num_stages}"
        return (s + {"gather": "", "reshape": "-rs", "pairs": "-pr", "split": "-sp"}[self.unpack]
                + ("" if self.fused_aq else "-aq2") + ("-sw" if self.swap else "") + ("-tma" if self.tma else ""))


if triton is not None:
    MAGIC = tl.constexpr(MAGIC_F)  # kernels read globals only as constexpr
    RNE = tl.constexpr(RNE_F)
    A8_DIV_C = tl.constexpr(A8_DIV)
    A8_LO = tl.constexpr(float(A8_QMIN))
    A8_HI = tl.constexpr(float(A8_QMAX))

    @triton.jit
    def _round_act(v, ADT: tl.constexpr):
        """fp32 v rounded half-even to the activations' dtype (ADT 0 fp32, 1 bf16, 2 fp16), returned in fp32:
        what torch does to the fp32 result of a bf16/fp16 op. bf16 through the bits, because the CPU
        interpreter's fp32 -> bf16 cast truncates."""
        if ADT == 1:
            b = v.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
            return b.to(tl.float32, bitcast=True)
        elif ADT == 2:
            return v.to(tl.float16).to(tl.float32)
        else:
            return v

    @triton.jit
    def _act_scale(amax, ADT: tl.constexpr, A_EPS: tl.constexpr):
        """Per-row scale from fp32 amax: amax / 127.5 in the activations' dtype, eps where that is 0."""
        s = _round_act(tl.math.div_rn(amax, A8_DIV_C), ADT)
        return tl.where(s == 0.0, A_EPS, s)

    @triton.jit
    def _act_codes(a, s, ADT: tl.constexpr):
        """int8 codes of a tile a (any float) with scales s broadcast against it: rne(clamp(x / s))."""
        v = _round_act(tl.math.div_rn(a.to(tl.float32), s), ADT)  # IEEE, as torch's x / s
        v = tl.minimum(tl.maximum(v, A8_LO), A8_HI)
        return ((v + RNE) - RNE).to(tl.int8)

    @triton.jit
    def _load_wtile(w_ptr, rn, kk, N, K, BITS: tl.constexpr, UNPACK: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr):
        """The weight tile [BN rows from rn, BK columns from kk] as int32: q (signed) for 8 bits, q + 8
        (in [0, 16)) for 4 bits."""
        nmask = rn[:, None] < N
        rk = kk + tl.arange(0, BK)
        if BITS == 4:
            if UNPACK == 0:
                words = tl.load(w_ptr + rn[:, None] * (K // 8) + rk[None, :] // 8, mask=nmask, other=0)
                nib = (words >> ((rk[None, :] % 8) * 4)) & 0xF
            else:
                rw = kk // 8 + tl.arange(0, BK // 8)
                words = tl.load(w_ptr + rn[:, None] * (K // 8) + rw[None, :], mask=nmask, other=0)
                sh = tl.arange(0, 8) * 4
                nib = tl.reshape((words[:, :, None] >> sh[None, None, :]) & 0xF, (BN, BK))
            return nib
        else:
            return tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=nmask, other=0).to(tl.int32)

    @triton.jit
    def _pair_bf16(v):
        """int32 v -> (bf16 of nibble bits [3:0], bf16 of bits [19:16]) minus 8, exact: one lop3 puts the two
        nibbles under bf16 exponent 2**7 (0x4300 | c == 128 + c), one bf16x2 subtract of 136 gives q."""
        return tl.inline_asm_elementwise(
            asm="{\n.reg .b32 t, m;\nlop3.b32 t, $2, 983055, 1124090624, 234;\nmov.b32 m, 1124614920;\n"
                "sub.rn.bf16x2 t, t, m;\nmov.b32 {$0, $1}, t;\n}",
            constraints="=h,=h,r", args=[v], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)

    @triton.jit
    def _w4_pairs_tile(w_ptr, rn, kk, N, K, BN: tl.constexpr, BK: tl.constexpr):
        """bf16 [BN, BK] of q (exact) in the permuted K order `_pairs_k` gives: two weights per three
        instructions instead of a shift, mask, convert and subtract each (GPU only: inline PTX)."""
        rw = kk // 8 + tl.arange(0, BK // 8)
        words = tl.load(w_ptr + rn[:, None] * (K // 8) + rw[None, :], mask=rn[:, None] < N, other=0)
        l0, h0 = _pair_bf16(words)
        l1, h1 = _pair_bf16(words >> 4)
        l2, h2 = _pair_bf16(words >> 8)
        l3, h3 = _pair_bf16(words >> 12)
        q0 = tl.join(tl.join(l0, h0), tl.join(l1, h1))  # [BN, W, h, t]: s = t
        q1 = tl.join(tl.join(l2, h2), tl.join(l3, h3))  # s = 2 + t
        return tl.reshape(tl.join(q0, q1), (BN, BK))  # column j*8 + 4h + 2t + u holds k = 8j + 4h + t + 2u

    @triton.jit
    def _pairs_k(kk, BK: tl.constexpr):
        """The K index of each column of _w4_pairs_tile."""
        c = tl.arange(0, BK)
        f = c % 8
        return kk + (c // 8) * 8 + (f // 4) * 4 + (f // 2) % 2 + (f % 2) * 2

    @triton.jit
    def _w_float_zp(wi, z_ptr, kk, rn, N, HAS_ZP: tl.constexpr, GROUP: tl.constexpr, half):
        """Unpacked codes int32 [BN, BK] -> the exact integer weight q - z as fp32 (2**23 + (q + half) - (2**23 + half))."""
        wf = ((wi + 128 - half).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC + 128.0)
        if HAS_ZP:
            z = tl.load(z_ptr + (kk // GROUP) * N + rn, mask=rn < N, other=0).to(tl.float32)
            wf = wf - z[:, None]
        return wf

    @triton.jit
    def _w4_pairs_zp(w_ptr, z_ptr, rn, kk, N, K, HAS_ZP: tl.constexpr, GROUP: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr):
        """The paired 4-bit tile (bf16 [BN, BK], K permuted as _pairs_k) minus the group's zero-point."""
        wb = _w4_pairs_tile(w_ptr, rn, kk, N, K, BN, BK)
        if HAS_ZP:
            z = tl.load(z_ptr + (kk // GROUP) * N + rn, mask=rn < N, other=0).to(tl.float32)
            wb = (wb.to(tl.float32) - z[:, None]).to(tl.bfloat16)
        return wb

    @triton.jit
    def _wq_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_xm, stride_ym,
                   BITS: tl.constexpr, A8: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                   PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr, UNPACK: tl.constexpr,
                   FUSED_AQ: tl.constexpr, sx_ptr, ADT: tl.constexpr, A_EPS: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                   GROUP_M: tl.constexpr, K_ITERS: tl.constexpr, DOT_F32: tl.constexpr):
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        # grouped ordering: GROUP_M row blocks share each column block while it sits in L2
        width = GROUP_M * num_n
        gid = pid // width
        first_m = gid * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gsize
        pid_n = (pid % width) // gsize
        # K is a compile-time constant: loop trip counts are static (the CPU interpreter cannot take a
        # run-time range bound), and a model has a handful of distinct K.

        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mmask = rm[:, None] < M
        k_len = K // SPLIT_K
        k0 = pid_k * k_len
        half = 8 if BITS == 4 else 0

        if A8:
            if FUSED_AQ:
                amax = tl.zeros([BM], dtype=tl.float32)
                for it in range(K // BK):
                    rk = it * BK + tl.arange(0, BK)
                    a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask, other=0.0)
                    amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))
                sx = _act_scale(amax, ADT, A_EPS)
            else:
                sx = tl.load(sx_ptr + rm, mask=rm < M, other=1.0)
            if PER_CHANNEL:
                acc_i = tl.zeros([BM, BN], dtype=tl.int32)
            else:
                acc = tl.zeros([BM, BN], dtype=tl.float32)
        else:
            acc = tl.zeros([BM, BN], dtype=tl.float32)

        for it in range(K_ITERS):  # = K // SPLIT_K // BK
            kk = k0 + it * BK
            rk = kk + tl.arange(0, BK)
            if not (UNPACK >= 2 and not A8) and not (A8 and BITS == 8):
                wi = _load_wtile(w_ptr, rn, kk, N, K, BITS, UNPACK, BN, BK)  # int32 [BN, BK]
            if A8:
                if FUSED_AQ:
                    a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask, other=0.0)
                    aq = _act_codes(a, sx[:, None], ADT)
                else:
                    aq = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask, other=0)
                if BITS == 8:
                    # int8 codes loaded straight into the dot, so the pipeliner can stage them asynchronously in
                    # shared memory (through int32 registers they were loaded synchronously, then stored back)
                    wq = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=rn[:, None] < N, other=0)
                else:
                    wq = (wi - half).to(tl.int8)
                part = tl.dot(aq, tl.trans(wq), out_dtype=tl.int32)  # [BM, BN]
                if PER_CHANNEL:
                    acc_i += part
                else:
                    s = tl.load(s_ptr + (kk // GROUP) * N + rn, mask=rn < N, other=0.0).to(tl.float32)
                    acc += part.to(tl.float32) * s[None, :]
            elif UNPACK == 3:  # 4-bit A16, split: one dot per nibble position, no reshape of the tile
                rw = kk // 8 + tl.arange(0, BK // 8)
                words = tl.load(w_ptr + rn[:, None] * (K // 8) + rw[None, :], mask=rn[:, None] < N, other=0)
                if HAS_ZP:
                    z = tl.load(z_ptr + (kk // GROUP) * N + rn, mask=rn < N, other=0).to(tl.float32)
                part = tl.zeros([BM, BN], dtype=tl.float32)
                for i in tl.static_range(8):
                    # nibble i of word j is k = kk + 8j + i: x's columns at that stride
                    ci = (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC + 8.0)
                    if HAS_ZP:
                        ci = ci - z[:, None]
                    xi = tl.load(x_ptr + rm[:, None] * stride_xm + (rw * 8 + i)[None, :], mask=mmask, other=0.0)
                    if DOT_F32:
                        part += tl.dot(xi.to(tl.float32), tl.trans(ci), input_precision="ieee")
                    else:
                        part += tl.dot(xi, tl.trans(ci.to(xi.dtype)))
                if PER_CHANNEL:
                    acc += part
                else:
                    s = tl.load(s_ptr + (kk // GROUP) * N + rn, mask=rn < N, other=0.0).to(tl.float32)
                    acc += part * s[None, :]
            elif UNPACK == 2:  # 4-bit, bf16 activations: the paired unpack (GPU)
                wb = _w4_pairs_zp(w_ptr, z_ptr, rn, kk, N, K, HAS_ZP, GROUP, BN, BK)
                a = tl.load(x_ptr + rm[:, None] * stride_xm + _pairs_k(kk, BK)[None, :], mask=mmask, other=0.0)
                part = tl.dot(a, tl.trans(wb))
                if PER_CHANNEL:
                    acc += part
                else:
                    s = tl.load(s_ptr + (kk // GROUP) * N + rn, mask=rn < N, other=0.0).to(tl.float32)
                    acc += part * s[None, :]
            else:
                a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask, other=0.0)
                wf = _w_float_zp(wi, z_ptr, kk, rn, N, HAS_ZP, GROUP, half)
                if DOT_F32:  # the CPU interpreter mis-converts fp32 -> bf16 inside a dot's operand
                    part = tl.dot(a.to(tl.float32), tl.trans(wf), input_precision="ieee")
                else:
                    part = tl.dot(a, tl.trans(wf.to(a.dtype)))  # [BM, BN] fp32
                if PER_CHANNEL:
                    acc += part
                else:
                    s = tl.load(s_ptr + (kk // GROUP) * N + rn, mask=rn < N, other=0.0).to(tl.float32)
                    acc += part * s[None, :]

        if A8:
            if PER_CHANNEL:
                s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
                acc = acc_i.to(tl.float32) * s[None, :]
            acc = acc * sx[:, None]
        elif PER_CHANNEL:
            s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            acc = acc * s[None, :]
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        ymask = mmask & (rn[None, :] < N)
        yp = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT_K == 1:
            tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ymask)
        else:
            tl.atomic_add(yp, acc, mask=ymask)

    @triton.jit
    def _wq_swap_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_xm, stride_ym,
                        BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PER_CHANNEL: tl.constexpr, GROUP: tl.constexpr, UNPACK: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SPLIT_K: tl.constexpr,
                        K_ITERS: tl.constexpr, DOT_F32: tl.constexpr):
        """A16 with the operands swapped: acc^T [BN weight rows, BM activation rows] = W_tile @ x_tile^T.
        Grid (N / BN * M / BM, SPLIT_K), the row blocks of one weight tile adjacent (its second read is
        an L2 hit). UNPACK 2 pairs, else reshape/gather through _load_wtile (no split: measured 0.06-0.62x bf16 on the
        H200, git history: `benchmarks/results/weights/gemm_explore_swap_split_NVIDIA_H200.log`)."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        num_m = tl.cdiv(M, BM)
        pid_n = pid // num_m
        pid_m = pid % num_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        mmask = rm[:, None] < M  # [BM, 1] for the x tile
        k0 = pid_k * (K // SPLIT_K)
        half = 8 if BITS == 4 else 0
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for it in range(K_ITERS):
            kk = k0 + it * BK
            if UNPACK == 2:
                wb = _w4_pairs_zp(w_ptr, z_ptr, rn, kk, N, K, HAS_ZP, GROUP, BN, BK)  # bf16 [BN, BK], K permuted
                a = tl.load(x_ptr + rm[:, None] * stride_xm + _pairs_k(kk, BK)[None, :], mask=mmask, other=0.0)
                part = tl.dot(wb, tl.trans(a))  # [BN, BM]
            else:
                wi = _load_wtile(w_ptr, rn, kk, N, K, BITS, UNPACK, BN, BK)
                wf = _w_float_zp(wi, z_ptr, kk, rn, N, HAS_ZP, GROUP, half)
                rk = kk + tl.arange(0, BK)
                a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mmask, other=0.0)
                if DOT_F32:  # the CPU interpreter mis-converts fp32 -> bf16 inside a dot's operand
                    part = tl.dot(wf, tl.trans(a.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(wf.to(a.dtype), tl.trans(a))
            if PER_CHANNEL:
                acc += part
            else:
                s = tl.load(s_ptr + (kk // GROUP) * N + rn, mask=rn < N, other=0.0).to(tl.float32)
                acc += part * s[:, None]
        if PER_CHANNEL:
            acc = acc * tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[:, None]
        ymask = (rn[:, None] < N) & (rm[None, :] < M)
        yp = y_ptr + rm[None, :] * stride_ym + rn[:, None]
        if SPLIT_K == 1:
            tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ymask)
        else:
            tl.atomic_add(yp, acc, mask=ymask)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_xm, stride_ym,
                     BITS: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, GPT: tl.constexpr, SPLIT_K: tl.constexpr,
                     K_ITERS: tl.constexpr, PER_CHANNEL: tl.constexpr):
        """A16 GEMV for M <= BM (1, 2, 4): no tensor cores, the weight tile read once for all rows.

        Tile: BN rows x GPT groups x the group's K (4-bit: WG = GROUP/8 words of 8 nibbles; 8-bit:
        GROUP bytes). Per group, sum_k x_k * c_k with c the unsigned code (exact via the 2**23 trick),
        then - (offset + zero) * sum_k x_k, times the group's scale: the offset and the zero-point cost
        one multiply per group, not one per weight."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BN + tl.arange(0, BN)
        nmask = rn < N
        rg = tl.arange(0, GPT)
        WG: tl.constexpr = GROUP // 8 if BITS == 4 else GROUP
        rj = tl.arange(0, WG)
        half = 8.0 if BITS == 4 else 128.0
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        rm = tl.arange(0, BM)
        k0 = pid_k * (K // SPLIT_K)
        for it in range(K_ITERS):
            g0 = (k0 + it * GPT * GROUP) // GROUP  # first group of the tile
            if PER_CHANNEL:  # one scale row for every tile
                sc = tl.load(s_ptr + rg[None, :] * 0 + rn[:, None], mask=nmask[:, None], other=0.0).to(tl.float32)
            else:
                sc = tl.load(s_ptr + (g0 + rg)[None, :] * N + rn[:, None], mask=nmask[:, None],
                             other=0.0).to(tl.float32)
            off = half
            if HAS_ZP:
                off = half + tl.load(z_ptr + (g0 + rg)[None, :] * N + rn[:, None], mask=nmask[:, None],
                                     other=0).to(tl.float32)  # [BN, GPT]
            if BITS == 4:
                # words [BN, GPT, WG]; nibble i of word j of group g is k = (g0 + g) * GROUP + 8j + i
                wo = rn[:, None, None] * (K // 8) + (g0 + rg)[None, :, None] * WG + rj[None, None, :]
                words = tl.load(w_ptr + wo, mask=nmask[:, None, None], other=0)
                xo = (g0 + rg)[:, None] * GROUP + rj[None, :] * 8  # [GPT, WG]
                for m in tl.static_range(BM):
                    d = tl.zeros([BN, GPT, WG], dtype=tl.float32)
                    xs = tl.zeros([GPT], dtype=tl.float32)
                    for i in tl.static_range(8):
                        ci = (((words >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - MAGIC
                        xi = tl.load(x_ptr + m * stride_xm + xo + i, mask=m < M, other=0.0).to(tl.float32)
                        d += ci * xi[None, :, :]
                        xs += tl.sum(xi, axis=1)
                    part = tl.sum((tl.sum(d, axis=2) - off * xs[None, :]) * sc, axis=1)  # [BN]
                    acc += tl.where(rm[:, None] == m, part[None, :], 0.0)
            else:
                wo = rn[:, None, None] * K + (g0 + rg)[None, :, None] * GROUP + rj[None, None, :]
                q = tl.load(w_ptr + wo, mask=nmask[:, None, None], other=0).to(tl.int32)  # [BN, GPT, GROUP]
                cf = ((q + 128) | 0x4B000000).to(tl.float32, bitcast=True) - MAGIC  # q + 128, exact
                xo = (g0 + rg)[:, None] * GROUP + rj[None, :]
                for m in tl.static_range(BM):
                    xm = tl.load(x_ptr + m * stride_xm + xo, mask=m < M, other=0.0).to(tl.float32)
                    dot = tl.sum(cf * xm[None, :, :], axis=2)
                    xs = tl.sum(xm, axis=1)
                    part = tl.sum((dot - off * xs[None, :]) * sc, axis=1)  # [BN]
                    acc += tl.where(rm[:, None] == m, part[None, :], 0.0)
        if HAS_BIAS:
            if pid_k == 0:
                acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        ymask = (rm[:, None] < M) & nmask[None, :]
        yp = y_ptr + rm[:, None] * stride_ym + rn[None, :]
        if SPLIT_K == 1:
            tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=ymask)
        else:
            tl.atomic_add(yp, acc, mask=ymask)

    @triton.jit
    def _w8a8_tma_kernel(a_desc, w_desc, sx_ptr, s_ptr, b_ptr, y_ptr, M, N, K: tl.constexpr, stride_ym,
                         HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr):
        """y [M, N] = (a_codes [M, K] int8 @ w [N, K] int8^T) * sx[m] * s[n] (+ bias): W8A8 per-channel with the
        activation codes from quantize_rows. Both tiles come through TMA descriptors, so Hopper's pipeliner stages
        them with the copy engine and mbarriers instead of per-thread loads; out-of-range rows and columns read 0."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        width = GROUP_M * num_n  # grouped ordering: GROUP_M row blocks share each column block while it is in L2
        first_m = (pid // width) * GROUP_M
        gsize = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % gsize
        pid_n = (pid % width) // gsize
        acc = tl.zeros([BM, BN], dtype=tl.int32)
        for kk in range(0, K, BK):
            a = a_desc.load([pid_m * BM, kk])  # [BM, BK] int8
            w = w_desc.load([pid_n * BN, kk])  # [BN, BK] int8
            acc += tl.dot(a, w.T, out_dtype=tl.int32)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
        s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        out = acc.to(tl.float32) * s[None, :] * sx[:, None]
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, K: tl.constexpr, stride_xm, BK: tl.constexpr, ADT: tl.constexpr,
                           A_EPS: tl.constexpr):
        """One row per program: the one quantizer's s and q (module docstring)."""
        row = tl.program_id(0)
        amax = tl.zeros([BK], dtype=tl.float32)
        for it in range(tl.cdiv(K, BK)):
            rk = it * BK + tl.arange(0, BK)
            a = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(a))
        s = _act_scale(tl.max(amax, axis=0), ADT, A_EPS)
        for it in range(tl.cdiv(K, BK)):
            rk = it * BK + tl.arange(0, BK)
            a = tl.load(x_ptr + row * stride_xm + rk, mask=rk < K, other=0.0)
            # through float32: Triton's interpreter casts int8 straight to bf16 as garbage
            tl.store(q_ptr + row * K + rk, _act_codes(a, s, ADT).to(tl.float32).to(q_ptr.dtype.element_ty), mask=rk < K)
        tl.store(s_ptr + row, s)

    @triton.jit
    def _dequant_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, BITS: tl.constexpr, HAS_ZP: tl.constexpr,
                        GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        """out [N, K] (bf16/fp16) = (q - zero) * scale: the fallback's weight for cuBLAS."""
        rn = tl.program_id(0) * BN + tl.arange(0, BN)
        k0 = tl.program_id(1) * BK
        rk = k0 + tl.arange(0, BK)
        wi = _load_wtile(w_ptr, rn, k0, N, K, BITS, 0, BN, BK)
        half = 8 if BITS == 4 else 0
        wf = ((wi + 128 - half).to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - (MAGIC + 128.0)
        g = rk // GROUP
        gmask = rn[:, None] < N
        if HAS_ZP:
            wf = wf - tl.load(z_ptr + g[None, :] * N + rn[:, None], mask=gmask, other=0).to(tl.float32)
        s = tl.load(s_ptr + g[None, :] * N + rn[:, None], mask=gmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn[:, None] * K + rk[None, :], (wf * s).to(out_ptr.dtype.element_ty), mask=gmask)


def _fit(cfg: GemmConfig, pw: PackedWeight) -> tuple[int, int]:
    """(BK, SPLIT_K) that tile this weight: BK divides the group (so a tile has one scale) and K."""
    BK = cfg.BK
    while BK > 16 and (pw.group % BK or pw.K % BK):
        BK //= 2
    if pw.group % BK or pw.K % BK:
        raise ValueError(f"no K tile for K={pw.K}, group {pw.group} (K must be a multiple of 16)")
    sk = cfg.SPLIT_K
    while sk > 1 and (pw.K // BK) % sk:
        sk -= 1
    return BK, sk


def _unpack_mode(cfg: GemmConfig, pw: PackedWeight, x: torch.Tensor, BK: int) -> int:
    """0 gather, 1 reshape, 2 pairs (4-bit A16 with bf16 activations on CUDA; else reshape), 3 split
    (4-bit A16; else reshape)."""
    if cfg.unpack == "split":
        return 3 if pw.bits == 4 and pw.a_bits == 16 and BK // 8 >= 16 else 1
    if cfg.unpack == "pairs":
        ok = pw.bits == 4 and pw.a_bits == 16 and x.dtype == torch.bfloat16 and x.device.type == "cuda"
        return 2 if ok else 1
    return 0 if cfg.unpack == "gather" else 1


def quantize_rows(x: torch.Tensor, codes_dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K] in codes_dtype, float32 [M]) with Triton; the twin is
    quantize_activations_per_token. codes_dtype bf16: the integer codes as an A16 kernel's input (exact)."""
    if codes_dtype not in (torch.int8, torch.bfloat16):
        raise ValueError(f"activation codes are int8 or bf16, not {codes_dtype}")
    M, K = x.shape
    q = torch.empty(M, K, dtype=codes_dtype, device=x.device)
    s = torch.empty(M, dtype=torch.float32, device=x.device)
    # read twice (amax, then codes): a one-pass form (s18, the row in registers up to K 8192 / 16384) was not
    # measurably faster at K 4096 and slower at K 14336 (NOTES round 15), so it was removed
    _quant_rows_kernel[(M,)](x, q, s, K, x.stride(0), BK=min(1024, triton.next_power_of_2(K)), ADT=_adt(x.dtype),
                             A_EPS=act_eps(x.dtype))
    return q, s


def linear(x: torch.Tensor, pw: PackedWeight, config: GemmConfig | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, rows contiguous) -> y [M, N] in out_dtype (default x's), through the Triton
    kernel. The audit asks for float32 to see the kernel's own error, not the output rounding."""
    out_dtype = out_dtype or x.dtype
    cfg = config or GemmConfig()
    M, K = x.shape
    if K != pw.K:
        raise ValueError(f"x has K={K}, the weight K={pw.K}")
    if x.stride(1) != 1:
        x = x.contiguous()
    BK, sk = _fit(cfg, pw)
    if pw.a_bits == 8 and x.device.type == "cuda" and BK < 32:
        raise ValueError(f"the int8 GEMM needs a K tile of at least 32 on CUDA (Triton's int8 dot); K={K}, group "
                         f"{pw.group} and config {cfg.name} leave {BK}: use a group that is a multiple of 32")
    if cfg.swap:
        return _linear_swap(x, pw, cfg, out_dtype, BK, sk)
    if cfg.tma:
        return _linear_w8a8_tma(x, pw, cfg, out_dtype, BK)
    sx = None
    xin = x
    if pw.a_bits == 8 and not cfg.fused_aq:
        xin, sx = quantize_rows(x)
    y = (torch.zeros(M, pw.N, dtype=torch.float32, device=x.device) if sk > 1
         else torch.empty(M, pw.N, dtype=out_dtype, device=x.device))
    grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(pw.N, cfg.BN), sk)
    _wq_kernel[grid](
        xin, pw.qweight, pw.scale, pw.zero if pw.zero is not None else pw.scale,
        pw.bias if pw.bias is not None else pw.scale, y, M, pw.N, K, xin.stride(0), y.stride(0),
        BITS=pw.bits, A8=pw.a_bits == 8, HAS_ZP=pw.zero is not None, HAS_BIAS=pw.bias is not None,
        PER_CHANNEL=pw.per_channel, GROUP=pw.group, UNPACK=_unpack_mode(cfg, pw, x, BK),
        FUSED_AQ=cfg.fused_aq, sx_ptr=sx if sx is not None else pw.scale,
        ADT=_adt(x.dtype) if pw.a_bits == 8 else 0, A_EPS=act_eps(x.dtype) if pw.a_bits == 8 else 0.0,
        BM=cfg.BM, BN=cfg.BN, BK=BK, SPLIT_K=sk, GROUP_M=cfg.GROUP_M, K_ITERS=K // sk // BK, DOT_F32=x.device.type == "cpu",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.to(out_dtype) if sk > 1 else y


def tma_why_not(pw: PackedWeight, cfg: GemmConfig) -> str | None:
    """None when the TMA kernel (cfg.tma) takes this weight, else why not (the dispatch passes such a cell over)."""
    if not (pw.a_bits == 8 and pw.bits == 8 and pw.per_channel and pw.zero is None):
        return f"tma config {cfg.name}: W8A8 per-channel symmetric weights only, not {pw.kind}"
    if cfg.fused_aq or cfg.SPLIT_K != 1 or cfg.swap:
        return f"tma config {cfg.name}: takes activation codes from their own kernel (-aq2), no split-K, no swap"
    if pw.K % 16:
        return f"tma config {cfg.name}: K={pw.K} must be a multiple of 16 (the descriptors' row stride)"
    return None


def _linear_w8a8_tma(x: torch.Tensor, pw: PackedWeight, cfg: GemmConfig, out_dtype: torch.dtype,
                     BK: int) -> torch.Tensor:
    """`linear` through _w8a8_tma_kernel (cfg.tma): W8A8 per-channel, activation codes from quantize_rows."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    reason = tma_why_not(pw, cfg)
    if reason:
        raise ValueError(reason)
    xq, sx = quantize_rows(x)
    y = torch.empty(x.shape[0], pw.N, dtype=out_dtype, device=x.device)
    a_desc = TensorDescriptor.from_tensor(xq, [cfg.BM, BK])
    w_desc = TensorDescriptor.from_tensor(pw.qweight, [cfg.BN, BK])
    grid = (triton.cdiv(x.shape[0], cfg.BM) * triton.cdiv(pw.N, cfg.BN),)
    _w8a8_tma_kernel[grid](a_desc, w_desc, sx, pw.scale, pw.bias if pw.bias is not None else pw.scale, y,
                           x.shape[0], pw.N, pw.K, y.stride(0), HAS_BIAS=pw.bias is not None, BM=cfg.BM, BN=cfg.BN,
                           BK=BK, GROUP_M=cfg.GROUP_M, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y


def _linear_swap(x: torch.Tensor, pw: PackedWeight, cfg: GemmConfig, out_dtype: torch.dtype, BK: int,
                 sk: int) -> torch.Tensor:
    """`linear` through _wq_swap_kernel (cfg.swap; A16 weights, BM >= 16)."""
    if pw.a_bits != 16:
        raise ValueError(f"swap configs are A16 only; this weight is {pw.kind}")
    if cfg.unpack == "split":
        raise ValueError(f"swap config {cfg.name}: the split unpack has no swapped kernel (use reshape or pairs)")
    if cfg.BM < 16 or cfg.BN < 16:
        raise ValueError(f"swap config {cfg.name}: BM and BN must be >= 16 (the dot's sides)")
    M = x.shape[0]
    y = (torch.zeros(M, pw.N, dtype=torch.float32, device=x.device) if sk > 1
         else torch.empty(M, pw.N, dtype=out_dtype, device=x.device))
    grid = (triton.cdiv(M, cfg.BM) * triton.cdiv(pw.N, cfg.BN), sk)
    _wq_swap_kernel[grid](
        x, pw.qweight, pw.scale, pw.zero if pw.zero is not None else pw.scale,
        pw.bias if pw.bias is not None else pw.scale, y, M, pw.N, pw.K, x.stride(0), y.stride(0),
        BITS=pw.bits, HAS_ZP=pw.zero is not None, HAS_BIAS=pw.bias is not None, PER_CHANNEL=pw.per_channel,
        GROUP=pw.group, UNPACK=_unpack_mode(cfg, pw, x, BK), BM=cfg.BM, BN=cfg.BN, BK=BK, SPLIT_K=sk,
        K_ITERS=pw.K // sk // BK, DOT_F32=x.device.type == "cpu", num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return y.to(out_dtype) if sk > 1 else y


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of `gemv` (A16, M <= BM): BN rows x GPT groups per tile, SPLIT_K K-splits."""

    BM: int = 1
    BN: int = 32
    GPT: int = 1
    SPLIT_K: int = 1
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def from_name(cls, name: str) -> GemvConfig:
        import re

        m = re.fullmatch(r"gemv-bm(\d+)-bn(\d+)-gpt(\d+)-sk(\d+)-w(\d+)-s(\d+)", name)
        if m is None:
            raise ValueError(f"not a GemvConfig name: {name!r}")
        return cls(*(int(m[i]) for i in range(1, 7)))

    @property
    def name(self) -> str:
        return f"gemv-bm{self.BM}-bn{self.BN}-gpt{self.GPT}-sk{self.SPLIT_K}-w{self.num_warps}-s{self.num_stages}"


def gemv(x: torch.Tensor, pw: PackedWeight, config: GemvConfig | None = None,
         out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (M <= config.BM) -> y [M, N]: the A16 GEMV kernel (4-bit or 8-bit weights)."""
    cfg = config or GemvConfig()
    M, K = x.shape
    out_dtype = out_dtype or x.dtype
    if pw.a_bits != 16 or M > cfg.BM:
        raise ValueError(f"gemv takes A16 weights and M <= {cfg.BM}, got a_bits {pw.a_bits}, M={M}")
    if x.stride(1) != 1:
        x = x.contiguous()
    group = pw.group
    gpt = cfg.GPT
    if pw.per_channel:  # per-channel 8-bit: tile K in power-of-two "groups" sharing the one scale row
        group = 256
        while K % group:
            group //= 2
    G = K // group
    sk = cfg.SPLIT_K
    while sk > 1 and (G % sk or (G // sk) % gpt):
        sk -= 1
    while (G // sk) % gpt:
        gpt //= 2
    scale = pw.scale
    y = (torch.zeros(M, pw.N, dtype=torch.float32, device=x.device) if sk > 1
         else torch.empty(M, pw.N, dtype=out_dtype, device=x.device))
    grid = (triton.cdiv(pw.N, cfg.BN), sk)
    _gemv_kernel[grid](x, pw.qweight, scale, pw.zero if pw.zero is not None else scale,
                       pw.bias if pw.bias is not None else scale, y, M, pw.N, K, x.stride(0), y.stride(0),
                       BITS=pw.bits, HAS_ZP=pw.zero is not None, HAS_BIAS=pw.bias is not None, GROUP=group,
                       BM=cfg.BM, BN=cfg.BN, GPT=gpt, SPLIT_K=sk, K_ITERS=G // sk // gpt, PER_CHANNEL=pw.per_channel,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y.to(out_dtype) if sk > 1 else y


def dequantize_kernel(pw: PackedWeight, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] in `dtype` through _dequant_kernel (the fallback path's weight)."""
    out = torch.empty(pw.N, pw.K, dtype=dtype, device=pw.qweight.device)
    BK = 128
    while pw.group % BK or pw.K % BK:
        BK //= 2
    grid = (triton.cdiv(pw.N, 32), pw.K // BK)
    _dequant_kernel[grid](pw.qweight, pw.scale, pw.zero if pw.zero is not None else pw.scale, out, pw.N, pw.K,
                          BITS=pw.bits, HAS_ZP=pw.zero is not None, GROUP=pw.group, BN=32, BK=BK)
    return out


def linear_dequant_cublas(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """A16 only: dequantize the whole weight (Triton) then cuBLAS -- wins where the GEMM is compute-bound."""
    if pw.a_bits != 16:
        raise ValueError("dequantize + cuBLAS is an A16 path (A8 would skip the activation quantization)")
    w = dequantize_kernel(pw, x.dtype)
    return torch.nn.functional.linear(x, w, None if pw.bias is None else pw.bias.to(x.dtype))


def random_weight(scheme_name: str, N: int, K: int, device, seed: int = 0):
    """A PackedWeight of `scheme_name` with random codes, scales (and zero-points if asymmetric)."""
    sch = parse_weight_scheme(scheme_name)
    group = sch.group_for(K)
    g = torch.Generator(device=device).manual_seed(seed)
    kw = {"generator": g, "device": device}
    codes = torch.randint(0, 2 ** sch.w_bits, (N, K), dtype=torch.uint8, **kw)
    if sch.a_bits == 8 and sch.w_bits == 8:
        codes = codes.clamp_(1, 255)  # symmetric int8: q in [-127, 127]
    scale = (torch.rand(N, K // group, **kw) * 0.02 + 0.002).to(torch.bfloat16)
    zp = None if sch.symmetric else torch.randint(-4, 4, (N, K // group), dtype=torch.int8, **kw)
    return pack_weight(codes, scale, zp, bits=sch.w_bits, group=group, a_bits=sch.a_bits)
