"""Tiny GGUF files for tests, written with the `gguf` package the way llama.cpp's converter lays
them out (its tensor names, its Q/K row permutation for Llama, its tokenizer metadata).

Block-quantized tensors come from `gguf.quants.quantize` where the package has a quantizer, and
from random blocks with small scales for the K-quants and i-quants (it only dequantizes those);
either way
ShardLM and transformers read the very same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from tests.checkpoints import TOKENIZER_TEXT

T = gguf.GGMLQuantizationType
QUANTIZABLE = (T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1)
# Byte offsets of the float16 scales (d, and dmin where there is one) inside each K-quant and
# i-quant block (IQ1_M keeps its d in the top nibbles of its last four uint16: `random_k_blocks`).
K_SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2),
                   T.Q6_K: (208,), T.IQ1_M: (),
                   **{t: (0,) for t in (T.IQ4_NL, T.IQ4_XS, T.IQ3_S, T.IQ3_XXS, T.IQ2_S,
                                        T.IQ2_XS, T.IQ2_XXS, T.IQ1_S)}}
# A type the `gguf` package knows and ShardLM refuses (BitNet's ternary blocks).
UNSUPPORTED_TYPE = T.TQ2_0
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
# phi3 keeps Hugging Face's fused tensors: attn_qkv ([q; k; v] rows), ffn_up ([gate; up] rows).
PHI3_MATRICES = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")


@dataclass
class GGUFSpec:
    arch: str  # "llama", "qwen2" or "qwen3" (per-head q/k norms)
    hidden: int = 256
    intermediate: int = 512
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    context: int = 512
    eps: float = 1e-5
    rope_base: float = 10000.0
    tied: bool = False
    bias: bool = False
    # Tensor type per llama.cpp tensor name ("blk.0.attn_q.weight"); the default for the others.
    types: dict[str, gguf.GGMLQuantizationType] = field(default_factory=dict)
    default_type: gguf.GGMLQuantizationType = T.F32
    pre_tokenizer: str = "default"
    tokenizer: str = "gpt2"  # tokenizer.ggml.model
    seed: int = 0
    key_length: int = 0  # head_dim where it is not hidden / heads (written as key_length)
    sliding_window: int = 0  # gemma3: the windowed layers' window
    # phi3: the rotated dims where not all of head_dim, the original context, LongRoPE's
    # (long, short) factor lists and its attention factor (llama.cpp's converter's keys).
    rotary_dim: int = 0
    original_context: int = 0
    rope_factors: tuple[list[float], list[float]] | None = None
    attn_factor: float = 0.0
    # llama: rope_freqs.weight (the converter's form of "llama3" rope scaling), and a linear
    # rope scaling factor in the metadata (0: none).
    rope_freqs: list[float] | None = None
    linear_rope: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """A small byte-level BPE (tokens, merges, llama.cpp token types) trained here."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TOKENIZER_TEXT * 4, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    types = [3 if t.startswith("<|") else 1 for t in tokens]
    return tokens, merges, types


CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for Llama (the inverse of what ShardLM undoes)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _encode(values: np.ndarray, qtype: gguf.GGMLQuantizationType,
            rng: np.random.Generator) -> np.ndarray:
    if qtype == T.F32:
        return values.astype(np.float32)
    if qtype == T.F16:
        return values.astype(np.float16)
    if qtype in QUANTIZABLE:
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    return random_k_blocks(*values.shape, qtype, rng)


def random_k_blocks(rows: int, cols: int, qtype: gguf.GGMLQuantizationType,
                    rng: np.random.Generator) -> np.ndarray:
    """K-quant blocks [rows, cols / 256 * bytes] the `gguf` package cannot make: random bytes,
    float16 scales of a quantizer's size (every field takes every value)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in K_SCALE_OFFSETS[qtype]:
        scale = rng.uniform(2e-4, 1e-3, blocks.shape[0]).astype(np.float16)
        blocks[:, offset:offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    if qtype == T.IQ1_M:  # d's bits 4i .. 4i+3 are the top nibble of uint16 i at byte 48
        bits = rng.uniform(2e-4, 1e-3, blocks.shape[0]).astype(np.float16).view(np.uint16)
        for i in range(4):
            nibble = ((bits >> (4 * i)) & 0x0F).astype(np.uint8)
            blocks[:, 49 + 2 * i] = (blocks[:, 49 + 2 * i] & 0x0F) | (nibble << 4)
    return blocks.reshape(rows, -1)


def write_gguf(path: Path, spec: GGUFSpec) -> dict[str, np.ndarray]:
    """Write the model `spec` describes to `path`; returns each tensor's float values in Hugging
    Face layout (before quantization and before llama.cpp's Q/K permutation)."""
    rng = np.random.default_rng(spec.seed)
    tokens, merges, token_types = byte_level_vocab()
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    a = spec.arch
    writer.add_name(f"tiny-{a}")
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.intermediate)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_dimension_count(spec.rotary_dim or spec.head_dim)
    if spec.key_length:
        writer.add_key_length(spec.key_length)
        writer.add_value_length(spec.key_length)
    if spec.sliding_window:
        writer.add_sliding_window(spec.sliding_window)
    writer.add_rope_freq_base(spec.rope_base)
    if spec.linear_rope:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.linear_rope)
    writer.add_layer_norm_rms_eps(spec.eps)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model(spec.tokenizer)
    writer.add_tokenizer_pre(spec.pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    if a == "phi3":
        _phi3_keys(writer, spec)
    q, kv, h, f = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim, spec.hidden, \
        spec.intermediate
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,)}
    if not spec.tied:
        shapes["output.weight"] = (vocab, h)
    for i in range(spec.layers):
        b = f"blk.{i}"
        shapes.update({f"{b}.attn_norm.weight": (h,), f"{b}.ffn_norm.weight": (h,),
                       f"{b}.attn_q.weight": (q, h), f"{b}.attn_k.weight": (kv, h),
                       f"{b}.attn_v.weight": (kv, h), f"{b}.attn_output.weight": (h, q),
                       f"{b}.ffn_gate.weight": (f, h), f"{b}.ffn_up.weight": (f, h),
                       f"{b}.ffn_down.weight": (h, f)})
        if spec.bias:
            shapes.update({f"{b}.attn_q.bias": (q,), f"{b}.attn_k.bias": (kv,),
                           f"{b}.attn_v.bias": (kv,)})
        if a in ("qwen3", "gemma3"):
            shapes.update({f"{b}.attn_q_norm.weight": (spec.head_dim,),
                           f"{b}.attn_k_norm.weight": (spec.head_dim,)})
        if a == "gemma3":  # norms after attention and the MLP
            shapes.update({f"{b}.post_attention_norm.weight": (h,),
                           f"{b}.post_ffw_norm.weight": (h,)})
        if a == "phi3":
            for part in ("attn_q", "attn_k", "attn_v", "ffn_gate"):
                del shapes[f"{b}.{part}.weight"]
            shapes.update({f"{b}.attn_qkv.weight": (q + 2 * kv, h), f"{b}.ffn_up.weight": (2 * f, h)})
    originals = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            values = (0.5 if name.startswith("token_embd") else 0.08) * rng.standard_normal(shape)
        values = values.astype(np.float32)
        originals[name] = values
        stored = values
        if a == "llama" and (".attn_q." in name or ".attn_k." in name):
            stored = llama_cpp_permute(values, spec.heads if ".attn_q." in name else spec.kv_heads)
        qtype = spec.types.get(name, spec.default_type) if len(shape) == 2 else T.F32
        data = _encode(stored, qtype, rng)
        writer.add_tensor(name, data, raw_dtype=qtype if qtype not in (T.F32, T.F16) else None)
    if spec.rope_factors is not None:  # llama.cpp writes them as float32 vectors
        for which, values in zip(("long", "short"), spec.rope_factors, strict=True):
            writer.add_tensor(f"rope_factors_{which}.weight", np.array(values, np.float32))
    if spec.rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.array(spec.rope_freqs, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return originals


def _phi3_keys(writer: gguf.GGUFWriter, spec: GGUFSpec) -> None:
    """What llama.cpp's converter writes for phi3 besides the shared keys (Phi3MiniModel)."""
    writer.add_rope_scaling_orig_ctx_len(spec.original_context or spec.context)
    if not spec.sliding_window:  # a window is written with the shared keys
        writer.add_sliding_window(0)  # 0: none, as the converter writes it for Phi-4
    writer.add_pad_token_id(0)  # transformers sizes its embedding's padding index by it
    if spec.rope_factors is not None:
        writer.add_rope_scaling_attn_factors(spec.attn_factor)


_HF_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
             "output": "lm_head", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm", "attn_output": "self_attn.o_proj",
             "ffn_down": "mlp.down_proj"}
_ARCH_HF_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "llama": {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj"},
}
_HF_ARCHITECTURES = {"phi3": "Phi3ForCausalLM", "llama": "LlamaForCausalLM"}


def hf_twin(folder: Path, spec: GGUFSpec, originals: dict[str, np.ndarray],
            config: dict) -> Path:
    """The Hugging Face folder of the phi3 or llama model `write_gguf` wrote from `originals`:
    the same values under transformers' names, with `config` (the config.json fields the file's
    metadata implies beyond the shared ones) as config.json; the reference a float32 GGUF file is
    compared with where transformers' GGUF loader does not read what the file states."""
    import json

    import torch
    from safetensors.torch import save_file

    names = dict(_HF_NAMES, **_ARCH_HF_NAMES[spec.arch])
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, values in originals.items():
        parts = name.split(".")
        if parts[0] == "blk":
            hf = f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        else:
            hf = f"{names[parts[0]]}.{parts[1]}"
        tensors[hf] = torch.from_numpy(values.copy())
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    raw = dict(architectures=[_HF_ARCHITECTURES[spec.arch]], model_type=spec.arch,
               hidden_size=spec.hidden, intermediate_size=spec.intermediate,
               num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
               num_key_value_heads=spec.kv_heads, max_position_embeddings=spec.context,
               rms_norm_eps=spec.eps, vocab_size=originals["token_embd.weight"].shape[0],
               rope_theta=spec.rope_base, tie_word_embeddings=spec.tied, bos_token_id=1,
               eos_token_id=2, pad_token_id=0, head_dim=spec.head_dim)
    if spec.arch == "phi3":
        raw.update(partial_rotary_factor=(spec.rotary_dim or spec.head_dim) / spec.head_dim,
                   sliding_window=spec.sliding_window or None)
    raw.update(config)
    (folder / "config.json").write_text(json.dumps(raw), encoding="utf-8")
    return folder


def every_type_once(spec: GGUFSpec, types: list[gguf.GGMLQuantizationType],
                    offset: int = 0) -> GGUFSpec:
    """`spec` with its matrices given the listed types in turn, so one small file holds them all."""
    matrices = PHI3_MATRICES if spec.arch == "phi3" else MATRICES
    names = ["token_embd.weight"] + [f"blk.{i}.{m}.weight" for i in range(spec.layers)
                                     for m in matrices]
    if not spec.tied:
        names.append("output.weight")
    spec.types = {n: types[(i + offset) % len(types)] for i, n in enumerate(names)}
    return spec


def copy_with_unsupported_type(src: Path, dst: Path, tensor: str) -> None:
    """Copy the GGUF file `src` to `dst` with `tensor` (a 2-D tensor) stored as UNSUPPORTED_TYPE
    (zeros suffice)."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), str(reader.fields["general.architecture"].contents()))
    for f in reader.fields.values():
        if not f.name.startswith("GGUF.") and f.name != "general.architecture":
            array = f.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if array else None)
    for t in reader.tensors:
        if t.name == tensor:
            rows, cols = (int(d) for d in reversed(t.shape.tolist()))
            block, size = gguf.GGML_QUANT_SIZES[UNSUPPORTED_TYPE]
            writer.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8),
                              raw_dtype=UNSUPPORTED_TYPE)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type
                              if t.tensor_type not in (T.F32, T.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
