// Few-row linear layers for CPU decoding: y[M,N] = x[M,K] . W[N,K]^T (+ b), with W prepacked once.
//
// Why our own kernel: a decode step multiplies 1..k*rows activation rows by every weight matrix. BLAS/oneDNN
// fp32 GEMM with so few rows runs well below the memory bound and its cost grows with the number of rows, so a
// k-token blockwise call costs several one-token calls (docs/experiments.md, the CPU decoding engine). Here W is
// packed into [N/64][K][64] blocks read in one linear stream (the hardware prefetcher's best case); each block is
// multiplied by up to 4 activation rows at once (16 vector accumulators, no horizontal sums), so k rows cost
// about what one row costs until the core runs out of FMA throughput. (AVX2 builds: [N/64][4][K][16], see the
// AVX2 kernels below: 16 ymm registers hold a quarter of what 32 zmm registers do.)
//
// Exactness: output (m, n) is always computed by the same instruction sequence (one FMA per k, in order),
// whatever M, the row blocking or the thread count.
// So a row gives bit-identical logits alone (greedy) or inside a k-row block (blockwise verification),
// and exact blockwise decoding is greedy decoding to the last bit, not just to the argmax.
//
// Weight formats: fp32; bf16 (upper half of the fp32 bits, upconverted exactly in registers); int8 with one
// fp32 scale per output row (weight-only quantisation: activations stay fp32). Compute formats where the CPU has
// them (BF16D, I8D below): bf16 x bf16 with vdpbf16ps, int8 x int8 with vpdpbusd, each activation row rounded /
// quantised on its own, so the row-exactness above holds for them too.
//
// The code is in parts by concern, one translation unit (each part's header says what it holds):
//   vec.h (vector helpers), kernels_fma.h / kernels_bf16.h / kernels_int8.h / kernels_amx.h (the kernels per
//   instruction set), kernels_q4.h (fp32 over 4-bit codes), kernels_q4q.h (4-bit codes x int8
//   activations per block of 32), run.h (kernel drivers), packed.h (packing, packed
//   linear layers), step.h (what every step shares), screen.h (screened argmax), attention.h, encdec.h / lm.h
//   (each model family's step), loops.h (the decode loops); this file: the module's bindings.
#include "vec.h"
#include "kernels_fma.h"
#include "kernels_bf16.h"
#include "kernels_int8.h"
#include "kernels_amx.h"
#include "kernels_q4.h"
#include "kernels_q4q.h"
#include "run.h"
#include "packed.h"
#include "step.h"
#include "sample.h"
#include "screen.h"
#include "attention.h"
#include "encdec.h"
#include "loop_model.h"
#include "sample_loop.h"
#include "loops.h"
#include "lm.h"

// per-phase seconds and steps since the last reset (phases: embed, decoder linears, decoder attention, decoder
// other (norms, residuals, SwiGLU's activation), head 1 (verify / greedy argmax), heads' FFN, proposal projection, other)
std::tuple<std::vector<double>, int64_t> profile(bool enable, bool reset) {
  std::vector<double> out(g_prof_s, g_prof_s + P_N);
  int64_t steps = g_prof_steps;
  if (reset) { for (auto& v : g_prof_s) v = 0.0; g_prof_steps = 0; }
  g_prof = enable;
  return {out, steps};
}

// screened argmax rows since the last reset: (rows, rows decided by the full fp32 pass, candidates computed exactly)
std::tuple<int64_t, int64_t, int64_t> screen_stats(bool reset) {
  std::tuple<int64_t, int64_t, int64_t> out{g_screen_rows.load(), g_screen_full.load(), g_screen_cand.load()};
  if (reset) g_screen_rows = g_screen_full = g_screen_cand = 0;
  return out;
}

std::string isa() { return BPD_NATIVE_ISA; }
bool bf16_dot() { return BPD_BF16_DOT; }
bool i8_dot() { return BPD_I8_DOT; }
// whether this build has AMX kernels and the process may use the tiles (mode BF16A; I8D from AMX_MIN_ROWS rows)
bool amx() {
#if BPD_AMX
  return amx_permitted();
#else
  return false;
#endif
}
void set_amx(bool on) {
#if BPD_AMX
  g_amx_off = !on;
#else
  (void)on;
#endif
}

// model/cache.py DecoderState reorder's common case: rows dst[i] of x (along dim) = rows src[i], the first `limit`
// entries along limit_dim only (limit < 0: all), in place; no dst row is a src row. One call from Python instead of
// a few ATen calls (and their index bookkeeping) per row.
void copy_rows(torch::Tensor x, int64_t dim, const std::vector<int64_t>& dst, const std::vector<int64_t>& src,
               int64_t limit_dim, int64_t limit) {
  TORCH_CHECK(dst.size() == src.size(), "copy_rows: dst and src differ in length");
  const int64_t ld = limit_dim - (limit_dim > dim ? 1 : 0);
  for (size_t i = 0; i < dst.size(); i++) {
    auto a = x.select(dim, dst[i]);
    auto b = x.select(dim, src[i]);
    if (limit >= 0) {
      a = a.narrow(ld, 0, limit);
      b = b.narrow(ld, 0, limit);
    }
    a.copy_(b);
  }
}

// A module tree's parameter states, the key under which packed decode weights stay valid (engine/packed.py
// weights_key): per parameter in registration order (the same walk as nn.Module.named_parameters without its
// dedup) its data pointer, in-place version and whether it is on the CPU, as bytes: the same walk as the Python one,
// without the interpreter's cost per module. Anything unexpected (a parameter that is not a tensor, a tensor
// without storage) raises, and the caller walks in Python.
static void param_states_walk(PyObject* mod, std::vector<int64_t>& out, int depth) {
  TORCH_CHECK(depth < 1000, "module tree too deep");
  static PyObject* s_params = PyUnicode_InternFromString("_parameters");
  static PyObject* s_mods = PyUnicode_InternFromString("_modules");
  PyObject* params = PyObject_GetAttr(mod, s_params);
  if (params == nullptr) throw pybind11::error_already_set();
  pybind11::object pguard = pybind11::reinterpret_steal<pybind11::object>(params);
  TORCH_CHECK(PyDict_Check(params), "_parameters is not a dict");
  PyObject *key, *val;
  Py_ssize_t pos = 0;
  while (PyDict_Next(params, &pos, &key, &val)) {
    if (val == Py_None) continue;
    TORCH_CHECK(THPVariable_Check(val), "a parameter is not a tensor");
    const at::Tensor& t = THPVariable_Unpack(val);
    out.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
    out.push_back(t._version());
    out.push_back(t.is_cpu() ? 1 : 0);
  }
  PyObject* mods = PyObject_GetAttr(mod, s_mods);
  if (mods == nullptr) throw pybind11::error_already_set();
  pybind11::object mguard = pybind11::reinterpret_steal<pybind11::object>(mods);
  TORCH_CHECK(PyDict_Check(mods), "_modules is not a dict");
  pos = 0;
  while (PyDict_Next(mods, &pos, &key, &val))
    if (val != Py_None) param_states_walk(val, out, depth + 1);
}

pybind11::bytes param_states(pybind11::handle module) {
  std::vector<int64_t> out;
  out.reserve(512);
  param_states_walk(module.ptr(), out, 0);
  return pybind11::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(int64_t));
}

// How many threads at::parallel_for really runs the kernels on: it is header code that is serial unless this file
// is built with OpenMP (fastlinear.py passes -fopenmp; without it "2 threads" ran every kernel on one).
int64_t parallel_threads(int64_t chunks) {
  std::vector<int> seen(256, 0);
  at::parallel_for(0, chunks, 1, [&](int64_t lo, int64_t hi) {
    const int t = at::get_thread_num();
    volatile double spin = 0;                       // long enough that one thread cannot take every chunk
    for (int64_t i = lo; i < hi; i++)
      for (int j = 0; j < 200000; j++) spin = spin + 1.0;
    if (t >= 0 && t < 256) seen[t] = 1;
  });
  int64_t n = 0;
  for (int v : seen) n += v;
  return n;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("parallel_threads", &parallel_threads, "distinct threads that ran the chunks of one at::parallel_for");
  m.def("pack", &pack, "pack a [N,K] float32 weight for linear()");
  m.def("huge_pages", &huge_pages, "a copy of a large tensor in memory advised for 2 MiB pages (else the tensor)");
  m.def("set_huge_pages", [](bool on) { g_huge_pages = on; }, "whether huge_pages copies (BPD_HUGEPAGES)");
  m.def("linear", &linear, "y = x . W^T (+ b) with a packed W");
  m.def("isa", &isa);
  m.def("i8_dot", &i8_dot, "whether mode 4 (int8 activations x int8 weights: vpdpbusd, or vpmaddwd on AVX2) is built");
  m.def("i8_avx2", []() { return (bool)BPD_I8_AVX2; }, "whether mode 4 runs on the AVX2 (vpmaddwd) kernels");
  m.def("amx", &amx, "whether AMX tiles run mode 5 (bf16) and int8 from 4 rows (this build, and the process may use them)");
  m.def("set_amx", &set_amx, "int8: whether AMX tiles may run it (bits unchanged either way)");
  m.def("q4q_vnni", []() { return (bool)BPD_Q4Q_VNNI; }, "whether mode 7 (4-bit weights x int8 blocks) runs on vpdpbusd (else AVX2)");
  m.def("bf16_dot", &bf16_dot, "whether mode 3 (bf16 activations x bf16 weights, vdpbf16ps) is built");
  pybind11::class_<Lin>(m, "Lin")
      .def(pybind11::init<torch::Tensor, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, int64_t,
                          int64_t>())
      .def("__call__", &Lin::operator())
      .def("add_screen", &Lin::add_screen, "screen this fp32 projection's argmax with an int8 copy of w [N, K]")
      .def("screened", [](const Lin& l) { return (bool)l.screen; });
  m.def("layer_norm", &layer_norm);
  m.def("norm_project_argmax", &norm_project_argmax);
  pybind11::class_<StepLayer>(m, "StepLayer")
      .def(pybind11::init<int64_t, double, torch::Tensor, torch::Tensor, Lin, Lin, torch::Tensor, torch::Tensor, Lin, Lin,
                          torch::Tensor, torch::Tensor, Lin, Lin>());
  m.def("decode_layers", &decode_layers);
  pybind11::class_<EncLayer>(m, "EncLayer")
      .def(pybind11::init<int64_t, double, torch::Tensor, torch::Tensor, Lin, Lin, torch::Tensor, torch::Tensor, Lin,
                          Lin>());
  m.def("encode_ids", &encode_ids);
  m.def("memory_kv", &memory_kv);
  m.def("propose", &propose);
  pybind11::class_<ChainProp>(m, "ChainProp")
      .def(pybind11::init<std::vector<Lin>, std::vector<Lin>, std::vector<Lin>, torch::Tensor, double>());
  m.def("propose_chain", &propose_chain);
  m.def("greedy_steps", &greedy_steps);
  m.def("block_steps", &block_steps);
  m.def("batch_block_steps", &batch_block_steps);
  m.def("profile", &profile);
  m.def("sampling_probs", &sampling_probs, "the native loops' sampling distribution of rows of logits (tests)");
  m.def("set_screen_two", [](bool on) { g_screen_two = on; }, "AVX2 builds: screen with two int8 passes, not one int16 pass");
  m.def("screen_stats", &screen_stats, "screened argmax rows, full-pass rows, exact candidates since the last reset");
  m.def("copy_rows", &copy_rows, "rows dst of x = rows src (cache reorders)");
  m.def("param_states", &param_states, "a module tree's parameter (data pointer, version, on CPU) as bytes");
  // decoder-only models (model/lm.py)
  pybind11::class_<LMLayer>(m, "LMLayer")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, torch::Tensor, Lin, Lin, torch::Tensor, Lin, Lin>());
  pybind11::class_<LMNet>(m, "LMNet")
      .def(pybind11::init<std::vector<LMLayer>, torch::Tensor, torch::Tensor, double, Lin>());
  pybind11::class_<LMProp>(m, "LMProp")
      .def(pybind11::init<int64_t, int64_t, int64_t, std::vector<Lin>, Lin, c10::optional<torch::Tensor>>());
  m.def("lm_decode_layers", &lm_decode_layers);
  m.def("rms_norm", &rms_norm);
  m.def("lm_head1_argmax", &lm_head1_argmax);
  m.def("lm_propose", &lm_propose, pybind11::arg("h"), pybind11::arg("net"), pybind11::arg("prop"),
        pybind11::arg("first") = pybind11::none());
  m.def("lm_greedy_steps", &lm_greedy_steps);
  m.def("lm_block_steps", &lm_block_steps);
  m.def("lm_batch_block_steps", &lm_batch_block_steps);
}
