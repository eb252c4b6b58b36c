// Operator schemas, CPU registrations and the Python module stub.
//
// The ops are plain dispatcher ops (torch.ops.shardlm.*), so the Python
// module itself exports nothing but build metadata. We use the bare CPython
// API instead of pybind11: importing `shardlm_server.worker._C` only has to dlopen the .so
// (which runs the static registrars below), and skipping pybind11's headers
// keeps the build noticeably faster.
#include <Python.h>
#include <torch/library.h>

#include <atomic>
#include <string>

#include "cpu/cpu_utils.h"
#include "cpu/fma_peak.h"
#include "cpu/subnormal.h"
#include "ops.h"

#ifndef SHARDLM_WITH_CUDA
#define SHARDLM_WITH_CUDA 0
#endif

TORCH_LIBRARY(shardlm, m) {
  // All ops write into caller-provided tensors and return nothing: the
  // serving loop preallocates activations and the KV cache, and `(a!)`
  // annotations let torch.compile / functionalization reason about it.
  m.def("rms_norm(Tensor(a!) out, Tensor input, Tensor weight, float eps) -> ()");
  m.def(
      "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
      "Tensor cos_sin_cache) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
  // Gemma's MLP activation: gelu(gate, approximate="tanh") * up.
  m.def("gelu_tanh_and_mul(Tensor(a!) out, Tensor input) -> ()");
  // CPU only: on a GPU, cuBLAS already streams skinny products at bandwidth.
  m.def("skinny_linear(Tensor(a!) out, Tensor input, Tensor weight, Tensor? bias) -> ()");
  // CPU only: W stays in GGML blocks (Q4_0 = 2, Q4_1 = 3, Q8_0 = 8); on a GPU
  // quantized weights are dequantized at load.
  m.def("quant_linear(Tensor(a!) out, Tensor input, Tensor blocks, int qtype, Tensor? bias) -> ()");
  // CPU only: rows `ids` of such a W as float32, the dequantized table's values
  // exactly (an embedding lookup that leaves the table packed).
  m.def("quant_rows(Tensor(a!) out, Tensor blocks, int qtype, Tensor ids) -> ()");
  // CPU only: a decoder layer's attention and MLP halves (cpu/decoder_block.cpp);
  // a weight's qtype is -1 when it is dense.
  m.def(
      "attention_block(Tensor(a!) out, Tensor(b!) hidden, Tensor(c!) residual, "
      "Tensor norm_weight, float eps, Tensor qkv_weight, int qkv_type, Tensor? qkv_bias, "
      "Tensor o_weight, int o_type, Tensor? o_bias, Tensor positions, Tensor cos_sin_cache, "
      "int num_heads, int num_kv_heads, int head_dim, Tensor(d!) key_cache, "
      "Tensor(e!) value_cache, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, "
      "Tensor query_start_loc, bool is_decode, int max_query_len, int max_seq_len, "
      "float scale, int sliding_window=0) -> ()");
  m.def(
      "mlp_block(Tensor(a!) out, Tensor(b!) hidden, Tensor(c!) residual, Tensor norm_weight, "
      "float eps, Tensor gate_up_weight, int gate_up_type, Tensor? gate_up_bias, "
      "Tensor down_weight, int down_type, Tensor? down_bias) -> ()");
  // The caches may hold another dtype than key / value / query: written
  // converted, read converted. sliding_window W > 0: a query at position p
  // sees keys p - W < j <= p only.
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
  m.def(
      "paged_attention_decode(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor context_lens, float scale, "
      "int max_context_len, int sliding_window=0) -> ()");
  m.def(
      "paged_attention_prefill(Tensor(a!) out, Tensor query, Tensor key_cache, "
      "Tensor value_cache, Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, "
      "float scale, int max_query_len, int max_seq_len, int sliding_window=0) -> ()");
  // CPU only: one token per row of float32 logits, drawn with one uniform
  // number a row after temperature, top-k, top-p and min-p (temperature 0:
  // greedy); a GPU samples with torch ops (worker/sampling.py).
  m.def(
      "sample_rows(Tensor(a!) out, Tensor logits, Tensor temperature, Tensor top_k, "
      "Tensor top_p, Tensor min_p, Tensor uniform) -> ()");
  // CPU only: the repetition, frequency and presence penalties in place, one
  // history (seen: bool [vocab], counts: int32 [vocab]; empty for none) a row.
  m.def(
      "penalize_rows(Tensor(a!) logits, Tensor[] seen, Tensor[] counts, Tensor repetition, "
      "Tensor frequency, Tensor presence) -> ()");
}

TORCH_LIBRARY_IMPL(shardlm, CPU, m) {
  m.impl("rms_norm", &shardlm::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &shardlm::fused_add_rms_norm_cpu);
  m.impl("rotary_embedding", &shardlm::rotary_embedding_cpu);
  m.impl("silu_and_mul", &shardlm::silu_and_mul_cpu);
  m.impl("gelu_tanh_and_mul", &shardlm::gelu_tanh_and_mul_cpu);
  m.impl("skinny_linear", &shardlm::skinny_linear_cpu);
  m.impl("quant_linear", &shardlm::quant_linear_cpu);
  m.impl("quant_rows", &shardlm::quant_rows_cpu);
  m.impl("attention_block", &shardlm::attention_block_cpu);
  m.impl("mlp_block", &shardlm::mlp_block_cpu);
  m.impl("reshape_and_cache", &shardlm::reshape_and_cache_cpu);
  m.impl("paged_attention_decode", &shardlm::paged_attention_decode_cpu);
  m.impl("paged_attention_prefill", &shardlm::paged_attention_prefill_cpu);
  m.impl("sample_rows", &shardlm::sample_rows_cpu);
  m.impl("penalize_rows", &shardlm::penalize_rows_cpu);
}

namespace {
// Stores the int `arg` into a process-wide `setting` if it lies in 0..max;
// otherwise raises a ValueError with `message` (or the conversion's TypeError).
PyObject* store_setting(PyObject* arg, long max, std::atomic<int>& setting, const char* message) {
  const long value = PyLong_AsLong(arg);
  if (value == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (value < 0 || value > max) {
    PyErr_SetString(PyExc_ValueError, message);
    return nullptr;
  }
  setting.store(static_cast<int>(value));
  Py_RETURN_NONE;
}

// set_cpu_simd(level: int) -> None: caps the CPU kernels' paths for the whole
// process: 0 portable, 1 AVX2, 2 AVX-512 (each only where the CPU has it).
PyObject* set_cpu_simd(PyObject* /*self*/, PyObject* arg) {
  return store_setting(arg, 2, shardlm::cpu::simd_cap(), "set_cpu_simd: level must be 0, 1 or 2");
}

// set_cpu_vnni(allowed: int) -> None: 0 keeps the AVX-512 VNNI paths off even
// where the CPU has them (the paths of an AVX-512 CPU without VNNI), 1 allows
// them (the default).
PyObject* set_cpu_vnni(PyObject* /*self*/, PyObject* arg) {
  return store_setting(arg, 1, shardlm::cpu::vnni_setting(), "set_cpu_vnni: must be 0 or 1");
}

// set_cpu_amx(allowed: int) -> None: 0 keeps the int8 mode's AMX path off even
// where the CPU has it (the VNNI kernels then take its rows), 1 allows it (the
// default).
PyObject* set_cpu_amx(PyObject* /*self*/, PyObject* arg) {
  return store_setting(arg, 1, shardlm::cpu::amx_setting(), "set_cpu_amx: must be 0 or 1");
}

// cpu_amx_active() -> bool: whether the int8 mode's many rows take AMX tiles now
// (this CPU and OS have them, and set_cpu_amx and set_cpu_vnni allow them).
PyObject* cpu_amx_active(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyBool_FromLong(shardlm::cpu::use_amx_int8() ? 1 : 0);
}

// set_activation_precision(precision: int) -> None: how quant_linear treats its
// input on CPU, for the whole process: 0 exact (float32), 1 rounded to int8
// per block of 32 for the grouped layouts, 2 rounded to 14-bit integers per
// block of 32, with the weights, in the panel path (cpu_utils.h).
PyObject* set_activation_precision(PyObject* /*self*/, PyObject* arg) {
  return store_setting(arg, 2, shardlm::cpu::activation_precision_setting(),
                       "set_activation_precision: precision must be 0, 1 or 2");
}

// set_cpu_subnormal_quants(mode: int) -> None: whether the exact 4- to 6-bit
// kernels read quants as float32 subnormals (cpu/subnormal.h): 0 never, 1
// always (with AVX2), 2 where this CPU does that at full speed (the default).
PyObject* set_cpu_subnormal_quants(PyObject* /*self*/, PyObject* arg) {
  return store_setting(arg, 2, shardlm::cpu::subnormal_quants_setting(),
                       "set_cpu_subnormal_quants: mode must be 0, 1 or 2");
}

// cpu_subnormal_quants_active() -> bool: whether they do now.
PyObject* cpu_subnormal_quants_active(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyBool_FromLong(shardlm::cpu::use_subnormal_quants() ? 1 : 0);
}

// cpu_fma_peak(iterations: int) -> float: the CPU's float32 FMA throughput in
// FLOP/s over all intra-op threads (cpu/fma_peak.h), for the benchmark.
PyObject* cpu_fma_peak(PyObject* /*self*/, PyObject* arg) {
  const long long iterations = PyLong_AsLongLong(arg);
  if (iterations == -1 && PyErr_Occurred()) {
    return nullptr;
  }
  if (iterations < 1) {
    PyErr_SetString(PyExc_ValueError, "cpu_fma_peak: iterations must be >= 1");
    return nullptr;
  }
  double flops = 0.0;
  Py_BEGIN_ALLOW_THREADS flops = shardlm::cpu::fma_peak_flops(iterations);
  Py_END_ALLOW_THREADS return PyFloat_FromDouble(flops);
}

// cpu_simd_active() -> bool: whether the CPU kernels take their AVX2 paths now
// (allowed by set_cpu_simd and supported by this CPU).
PyObject* cpu_simd_active(PyObject* /*self*/, PyObject* /*unused*/) {
  return PyBool_FromLong(shardlm::cpu::use_avx2() ? 1 : 0);
}

// skinny_max_rows(dtype: str) -> int: see ops.h; dtype is torch's name without
// the prefix ("float32", "bfloat16", "float16").
PyObject* skinny_max_rows(PyObject* /*self*/, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) {
    return nullptr;
  }
  const std::string dtype(name);
  at::ScalarType type = at::kFloat;
  if (dtype == "bfloat16") {
    type = at::kBFloat16;
  } else if (dtype == "float16") {
    type = at::kHalf;
  } else if (dtype != "float32") {
    PyErr_SetString(PyExc_ValueError, "skinny_max_rows: dtype must be float32, bfloat16 or float16");
    return nullptr;
  }
  return PyLong_FromLongLong(shardlm::skinny_max_rows(type));
}

PyMethodDef shardlm_methods[] = {
    {"set_cpu_simd", set_cpu_simd, METH_O,
     "set_cpu_simd(level: int) -> None: cap the CPU kernels' paths (0 portable, 1 AVX2, "
     "2 AVX-512)."},
    {"set_cpu_vnni", set_cpu_vnni, METH_O,
     "set_cpu_vnni(allowed: int) -> None: 0 keeps the AVX-512 VNNI paths off, 1 allows them."},
    {"set_cpu_amx", set_cpu_amx, METH_O,
     "set_cpu_amx(allowed: int) -> None: 0 keeps the int8 mode's AMX path off, 1 allows it."},
    {"cpu_amx_active", cpu_amx_active, METH_NOARGS,
     "cpu_amx_active() -> bool: whether the int8 mode's many rows take AMX tiles now."},
    {"set_activation_precision", set_activation_precision, METH_O,
     "set_activation_precision(precision: int) -> None: quant_linear's CPU input for the "
     "grouped layouts (0 exact float32, 1 int8 per block of 32, 2 int16 panels)."},
    {"set_cpu_subnormal_quants", set_cpu_subnormal_quants, METH_O,
     "set_cpu_subnormal_quants(mode: int) -> None: exact 4- to 6-bit kernels read quants as "
     "subnormals: 0 never, 1 always (AVX2), 2 where as fast (default)."},
    {"cpu_subnormal_quants_active", cpu_subnormal_quants_active, METH_NOARGS,
     "cpu_subnormal_quants_active() -> bool: whether they do now."},
    {"cpu_fma_peak", cpu_fma_peak, METH_O,
     "cpu_fma_peak(iterations: int) -> float: measured float32 FMA FLOP/s of all threads."},
    {"cpu_simd_active", cpu_simd_active, METH_NOARGS,
     "cpu_simd_active() -> bool: whether the CPU kernels take their AVX2 paths."},
    {"skinny_max_rows", skinny_max_rows, METH_O,
     "skinny_max_rows(dtype: str) -> int: most input rows skinny_linear takes for a dense "
     "weight of that dtype."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef shardlm_module = {
    PyModuleDef_HEAD_INIT,
    "_C",
    "ShardLM compiled ops; they are registered as torch.ops.shardlm.* on import.",
    -1,
    shardlm_methods,
};
}  // namespace

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* mod = PyModule_Create(&shardlm_module);
  if (mod == nullptr) {
    return nullptr;
  }
  // Build metadata so Python can tell a CPU-only build from a CUDA one.
  if (PyModule_AddIntConstant(mod, "cuda_built", SHARDLM_WITH_CUDA) != 0) {
    Py_DECREF(mod);
    return nullptr;
  }
  return mod;
}
