// compcomm._C.optim: the CPU Adam / AdamW step and the 1-bit Adam updates (cpp/kernels/cpu_adam.h).
// Exports only, plus the argument checks of this entry point: host buffers, dtypes, equal counts,
// no partial overlap; a bad argument raises ValueError / TypeError naming it. The Python layer
// (compcomm.optim.cpu_adam) checks what a Buffer cannot show (torch device, contiguity).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "../common.h"
#include "../kernels/cpu_adam.h"

namespace py = pybind11;
using namespace compcomm;
namespace K = compcomm::kernels::cpu;
using compcomm::detail::concat;

// The isa / sqrt arguments' names (shared with lamb_bindings.cpp).
namespace compcomm::optim_bindings {

K::AdamIsa isa_of(const std::string& s) {
  if (s == "auto") return K::AdamIsa::kAuto;
  if (s == "generic") return K::AdamIsa::kGeneric;
  if (s == "avx2") return K::AdamIsa::kAvx2;
  if (s == "avx512") return K::AdamIsa::kAvx512;
  throw py::value_error(concat("isa must be 'auto', 'generic', 'avx2' or 'avx512', got '", s, "'"));
}

K::SqrtMode sqrt_of(const std::string& s) {
  if (s == "ieee") return K::SqrtMode::kIeee;
  if (s == "rsqrt14") return K::SqrtMode::kRsqrt14;
  throw py::value_error(concat("sqrt must be 'ieee' or 'rsqrt14', got '", s, "'"));
}

}  // namespace compcomm::optim_bindings

using compcomm::optim_bindings::isa_of;
using compcomm::optim_bindings::sqrt_of;

namespace {

[[noreturn]] void type_error(const std::string& s) { throw py::type_error(s); }
[[noreturn]] void value_error(const std::string& s) { throw py::value_error(s); }

kernels::InputType float_type(const char* fn, const char* name, const Buffer& b, bool any_float) {
  if (b.dtype == DType::kFloat32) return kernels::InputType::kFloat32;
  if (any_float && b.dtype == DType::kFloat16) return kernels::InputType::kFloat16;
  if (any_float && b.dtype == DType::kBFloat16) return kernels::InputType::kBFloat16;
  type_error(concat(fn, ": ", name, " must be ",
                    any_float ? "float32, float16 or bfloat16" : "float32", ", got ",
                    dtype_name(b.dtype)));
}

void check_buffer(const char* fn, const char* name, const Buffer& b, int64_t n,
                  const char* ref = "w") {
  if (!b.on_host())
    value_error(concat(fn, ": ", name, " must be in host memory, got CUDA device ", b.device));
  if (b.count != n)
    value_error(concat(fn, ": ", name, " has ", b.count, " elements, ", ref, " has ", n));
  if (n > 0 && b.data == nullptr) value_error(concat(fn, ": ", name, " is a null buffer"));
}

bool overlap(const Buffer& a, const Buffer& b) {
  const auto a0 = reinterpret_cast<uintptr_t>(a.data), b0 = reinterpret_cast<uintptr_t>(b.data);
  return a.count > 0 && b.count > 0 && a0 < b0 + static_cast<uintptr_t>(b.bytes()) &&
         b0 < a0 + static_cast<uintptr_t>(a.bytes());
}

struct Named {
  const char* name;
  const Buffer* buf;
};

// Written buffers may not overlap each other; a read-only one may be the very same memory as a
// written one (the update is elementwise) but not overlap it partly.
void check_aliasing(const char* fn, std::initializer_list<Named> written,
                    std::initializer_list<Named> read) {
  for (auto i = written.begin(); i != written.end(); ++i) {
    for (auto j = i + 1; j != written.end(); ++j)
      if (overlap(*i->buf, *j->buf))
        value_error(concat(fn, ": ", i->name, " and ", j->name, " overlap"));
    for (const Named& r : read)
      if (overlap(*i->buf, *r.buf) &&
          !(i->buf->data == r.buf->data && i->buf->bytes() == r.buf->bytes()))
        value_error(concat(fn, ": ", r.name, " partly overlaps ", i->name));
  }
}

const char* isa_name(K::AdamIsa isa) {
  switch (isa) {
    case K::AdamIsa::kAvx512:
      return "avx512";
    case K::AdamIsa::kAvx2:
      return "avx2";
    case K::AdamIsa::kGeneric:
      return "generic";
    case K::AdamIsa::kAuto:
      break;
  }
  return "auto";
}

// Checks the buffers of one update, fills t, and runs it (GIL released by the caller's guard).
void run(const char* fn, K::AdamCoeffs c, const std::string& sqrt, const Buffer& w, const Buffer& m,
         const Buffer& v, const Buffer& g, const char* g_name, const std::optional<Buffer>& mask,
         const std::optional<Buffer>& param_out, int num_threads, const std::string& isa) {
  c.sqrt = sqrt_of(sqrt);
  const K::AdamIsa which = isa_of(isa);
  if (!K::adam_isa_supported(which))
    value_error(concat(fn, ": isa '", isa, "' is not available on this machine or in this build"));
  const int64_t n = w.count;
  K::AdamTensors t;
  t.g_type = float_type(fn, g_name, g, c.rule != K::AdamRule::kOneBitCompressed);
  float_type(fn, "w", w, false);
  float_type(fn, "m", m, false);
  float_type(fn, "v", v, false);
  check_buffer(fn, "w", w, n);
  check_buffer(fn, "m", m, n);
  check_buffer(fn, "v", v, n);
  check_buffer(fn, g_name, g, n);
  const Buffer none{};
  const Buffer& k = mask ? *mask : none;
  const Buffer& out = param_out ? *param_out : none;
  if (mask) {
    float_type(fn, "mask", k, false);
    check_buffer(fn, "mask", k, n);
  }
  if (param_out) {
    t.out_type = float_type(fn, "param_out", out, true);
    check_buffer(fn, "param_out", out, n);
  }
  if (c.rule == K::AdamRule::kOneBitCompressed || c.rule == K::AdamRule::kOneBitLocal)
    // v is only read
    check_aliasing(fn, {{"w", &w}, {"m", &m}, {"param_out", &out}},
                   {{g_name, &g}, {"mask", &k}, {"v", &v}});
  else
    check_aliasing(fn, {{"w", &w}, {"m", &m}, {"v", &v}, {"param_out", &out}}, {{g_name, &g}});
  if (num_threads < 0) value_error(concat(fn, ": num_threads must be >= 0, got ", num_threads));
  t.w = static_cast<float*>(w.data);
  t.m = static_cast<float*>(m.data);
  t.v = static_cast<float*>(v.data);
  t.g = g.data;
  t.mask = mask ? static_cast<const float*>(k.data) : nullptr;
  t.param_out = param_out ? out.data : nullptr;
  kernels::Status s;
  {
    py::gil_scoped_release release;
    s = K::adam_update(c, t, n, num_threads, which);
  }
  if (s != kernels::Status::kSuccess)
    value_error(concat(fn, ": the kernel rejected its arguments"));
}

// onebit_{local,warmup,compressed}_steps: one rule over lists of tensors given as data
// pointers (the caller validated them), the GIL released once. gs: the gradients (local, warm-up)
// or the averaged momenta (compressed); all fp32.
void run_steps(const char* fn, K::AdamRule rule, const std::vector<int64_t>& numels,
               const std::vector<uintptr_t>& ws, const std::vector<uintptr_t>& ms,
               const std::vector<uintptr_t>& vs, const std::vector<uintptr_t>& gs,
               const std::vector<uintptr_t>& outs, const std::vector<DType>& out_types, double lr,
               double b1, double b2, double eps, double wd, bool bias_correction, int64_t bc1_t,
               int64_t bc2_t, int num_threads, const std::string& isa, const std::string& sqrt,
               const std::vector<DType>& g_types, bool v_is_denom,
               const std::vector<uintptr_t>& accs) {
  const size_t k = numels.size();
  if (rule == K::AdamRule::kZeroOneLocal && accs.size() != k)
    value_error(concat(fn, ": accs must hold ", k, " pointers (one per numel)"));
  if (rule != K::AdamRule::kZeroOneLocal && !accs.empty())
    value_error(concat(fn, ": accs is only for zero_one_local_steps"));
  if (!g_types.empty() && g_types.size() != k)
    value_error(concat(fn, ": g_types must be empty (all float32) or hold ", k, " entries"));
  if (ws.size() != k || ms.size() != k || vs.size() != k || gs.size() != k)
    value_error(concat(fn, ": ws, ms, vs and gs must hold ", k, " pointers (one per numel)"));
  if (!(outs.empty() && out_types.empty()) && (outs.size() != k || out_types.size() != k))
    value_error(concat(fn, ": outs and out_types must be empty or hold ", k, " entries"));
  if (bc1_t < 0 || bc2_t < 0)
    value_error(concat(fn, ": bc1_t and bc2_t must be >= 0, got ", bc1_t, ", ", bc2_t));
  if (num_threads < 0) value_error(concat(fn, ": num_threads must be >= 0, got ", num_threads));
  const K::AdamIsa which = isa_of(isa);
  if (!K::adam_isa_supported(which))
    value_error(concat(fn, ": isa '", isa, "' is not available on this machine or in this build"));
  if (v_is_denom && rule == K::AdamRule::kOneBitWarmup)
    value_error(concat(fn, ": v_is_denom needs a frozen variance (the warm-up step updates v)"));
  K::AdamCoeffs c = K::onebit_coeffs(rule, lr, b1, b2, eps, wd, bias_correction, bc1_t, bc2_t);
  c.sqrt = sqrt_of(sqrt);
  c.v_is_denom = v_is_denom;
  std::vector<K::AdamTensors> ts(k);
  for (size_t i = 0; i < k; ++i) {
    if (numels[i] < 0) value_error(concat(fn, ": numels[", i, "] is negative"));
    if (numels[i] > 0 && (!ws[i] || !ms[i] || !vs[i] || !gs[i] || (!accs.empty() && !accs[i])))
      value_error(concat(fn, ": a null pointer for tensor ", i));
    K::AdamTensors& t = ts[i];
    if (!accs.empty()) t.acc = reinterpret_cast<float*>(accs[i]);
    t.w = reinterpret_cast<float*>(ws[i]);
    t.m = reinterpret_cast<float*>(ms[i]);
    t.v = reinterpret_cast<float*>(vs[i]);
    t.g = reinterpret_cast<const void*>(gs[i]);
    if (!g_types.empty() && g_types[i] != DType::kFloat32) {
      // a 16-bit gradient is read as is (converted in registers, exactly); the compressed rule's
      // averaged momentum is fp32 only
      if (rule == K::AdamRule::kOneBitCompressed ||
          (g_types[i] != DType::kFloat16 && g_types[i] != DType::kBFloat16))
        type_error(concat(fn, ": g_types[", i, "] must be float32",
                          rule == K::AdamRule::kOneBitCompressed ? "" : ", float16 or bfloat16"));
      t.g_type = g_types[i] == DType::kFloat16 ? kernels::InputType::kFloat16
                                               : kernels::InputType::kBFloat16;
    }
    if (!outs.empty() && outs[i] != 0) {
      t.param_out = reinterpret_cast<void*>(outs[i]);
      if (out_types[i] == DType::kFloat16)
        t.out_type = kernels::InputType::kFloat16;
      else if (out_types[i] == DType::kBFloat16)
        t.out_type = kernels::InputType::kBFloat16;
      else if (out_types[i] != DType::kFloat32)
        type_error(concat(fn, ": out_types[", i, "] must be float32, float16 or bfloat16"));
    }
  }
  bool ok = true;
  {
    py::gil_scoped_release release;
    for (size_t i = 0; i < k && ok; ++i)
      ok = K::adam_update(c, ts[i], numels[i], num_threads, which) == kernels::Status::kSuccess;
  }
  if (!ok) value_error(concat(fn, ": the kernel rejected its arguments"));
}

}  // namespace

void bind_optim_lamb(py::module_& m);  // lamb_bindings.cpp

void bind_optim(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "optim",
      "CPU Adam / AdamW and the 1-bit Adam updates: one vectorised, multi-threaded pass over fp32 "
      "w, m, "
      "v and the gradient, optionally writing a bf16/fp16 copy of the new parameter (see "
      "compcomm.optim.cpu_adam for the torch-tensor wrappers).");

  m.def(
      "adam_step",
      [](const Buffer& w, const Buffer& m_, const Buffer& v, const Buffer& g, double lr, double b1,
         double b2, double eps, double wd, int64_t step, bool adamw_mode, bool bias_correction,
         const std::optional<Buffer>& param_out, int num_threads, const std::string& isa,
         const std::string& sqrt) {
        if (step < 1)
          value_error(concat("adam_step: step must be >= 1 (the step being taken), got ", step));
        run("adam_step", K::adam_coeffs(lr, b1, b2, eps, wd, step, adamw_mode, bias_correction),
            sqrt, w, m_, v, g, "g", std::nullopt, param_out, num_threads, isa);
      },
      py::arg("w"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("lr"), py::arg("b1"),
      py::arg("b2"), py::arg("eps"), py::arg("wd"), py::arg("step"), py::arg("adamw_mode") = true,
      py::arg("bias_correction") = true, py::arg("param_out") = py::none(),
      py::arg("num_threads") = 0, py::arg("isa") = "auto", py::arg("sqrt") = "ieee",
      "One torch.optim.AdamW step (adamw_mode) or Adam step with L2 weight decay, in place on fp32 "
      "w, m, v "
      "from g (fp32/fp16/bf16); step: the step being taken (>= 1). param_out: also write the new w "
      "there "
      "(fp32/fp16/bf16). num_threads 0: the OpenMP default. sqrt: 'ieee' or 'rsqrt14' (torch's CPU "
      "sqrt with "
      "MKL on AVX-512; see compcomm.optim.cpu_adam.torch_sqrt_mode).");

  // The two 1-bit rules that read a gradient g (warm-up: both moments from g; local: the momentum
  // from g with the variance frozen): one binding each, same arguments.
  auto def_g_step = [&m](const char* name, K::AdamRule rule, const char* doc) {
    m.def(
        name,
        [name, rule](const Buffer& w, const Buffer& m_, const Buffer& v, const Buffer& g, double lr,
                     double b1, double b2, double eps, double wd, bool bias_correction, int64_t bc1_t,
                     int64_t bc2_t, const std::optional<Buffer>& param_out, int num_threads,
                     const std::string& isa, const std::string& sqrt) {
          if (bc1_t < 0 || bc2_t < 0)
            value_error(concat(name, ": bc1_t and bc2_t must be >= 0, got ", bc1_t, ", ", bc2_t));
          run(name, K::onebit_coeffs(rule, lr, b1, b2, eps, wd, bias_correction, bc1_t, bc2_t), sqrt,
              w, m_, v, g, "g", std::nullopt, param_out, num_threads, isa);
        },
        py::arg("w"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("lr"), py::arg("b1"),
        py::arg("b2"), py::arg("eps"), py::arg("wd"), py::arg("bias_correction"), py::arg("bc1_t"),
        py::arg("bc2_t"), py::arg("param_out") = py::none(), py::arg("num_threads") = 0,
        py::arg("isa") = "auto", py::arg("sqrt") = "ieee", doc);
  };
  def_g_step("onebit_warmup_step", K::AdamRule::kOneBitWarmup,
             "1-bit Adam's warm-up step, bit for bit functional.adam_moments_ then "
             "functional.adam_step_ on the CPU: both moments from g, then w -= lr * (m / (sqrt(v) + "
             "eps) (+ wd w)), corrected at steps bc1_t / bc2_t when bias_correction.");
  def_g_step("onebit_local_step", K::AdamRule::kOneBitLocal,
             "1-bit Adam's compressed-phase step in a world of one rank, bit for bit "
             "functional.onebit_momentum(m, g) as the average, then onebit_compressed_step: "
             "m = b1 m + (1-b1) g, then w -= lr * (m / (sqrt(v) + eps) (+ wd w)); v is only read.");

  m.def(
      "onebit_compressed_step",
      [](const Buffer& w, const Buffer& m_, const Buffer& v, const Buffer& averaged,
         const std::optional<Buffer>& mask, double lr, double b1, double b2, double eps, double wd,
         bool bias_correction, int64_t bc1_t, int64_t bc2_t, const std::optional<Buffer>& param_out,
         int num_threads, const std::string& isa, const std::string& sqrt, bool v_is_denom) {
        if (bc1_t < 0 || bc2_t < 0)
          value_error(concat("onebit_compressed_step: bc1_t and bc2_t must be >= 0, got ", bc1_t,
                             ", ", bc2_t));
        K::AdamCoeffs c = K::onebit_coeffs(K::AdamRule::kOneBitCompressed, lr, b1, b2, eps, wd,
                                           bias_correction, bc1_t, bc2_t);
        c.v_is_denom = v_is_denom;
        run("onebit_compressed_step", c, sqrt, w, m_, v, averaged, "averaged", mask, param_out,
            num_threads, isa);
      },
      py::arg("w"), py::arg("m"), py::arg("v"), py::arg("averaged"), py::arg("mask"), py::arg("lr"),
      py::arg("b1"), py::arg("b2"), py::arg("eps"), py::arg("wd"), py::arg("bias_correction"),
      py::arg("bc1_t"), py::arg("bc2_t"), py::arg("param_out") = py::none(),
      py::arg("num_threads") = 0, py::arg("isa") = "auto", py::arg("sqrt") = "ieee",
      py::arg("v_is_denom") = false,
      "1-bit Adam's compressed-phase step, bit for bit m.copy_(averaged), m *= mask (mask may be "
      "None), "
      "functional.adam_step_ with the frozen bc2_t, on the CPU; v is only read. v_is_denom: v holds "
      "functional.adam_denom(v, group, bc2_t), used as the denominator as is.");


  // The list forms: one crossing into C++ for a whole list of tensors (a step of many small
  // tensors paid ~10 us of Python per tensor and call).
  auto def_steps = [&m](const char* name, K::AdamRule rule, const char* doc) {
    m.def(
        name,
        [name, rule](const std::vector<int64_t>& numels, const std::vector<uintptr_t>& ws,
                     const std::vector<uintptr_t>& ms, const std::vector<uintptr_t>& vs,
                     const std::vector<uintptr_t>& gs, const std::vector<uintptr_t>& outs,
                     const std::vector<DType>& out_types, double lr, double b1, double b2,
                     double eps, double wd, bool bias_correction, int64_t bc1_t, int64_t bc2_t,
                     int num_threads, const std::string& isa, const std::string& sqrt,
                     const std::vector<DType>& g_types, bool v_is_denom,
                     const std::vector<uintptr_t>& accs) {
          run_steps(name, rule, numels, ws, ms, vs, gs, outs, out_types, lr, b1, b2, eps, wd,
                    bias_correction, bc1_t, bc2_t, num_threads, isa, sqrt, g_types, v_is_denom,
                    accs);
        },
        py::arg("numels"), py::arg("ws"), py::arg("ms"), py::arg("vs"), py::arg("gs"),
        py::arg("outs"), py::arg("out_types"), py::arg("lr"), py::arg("b1"), py::arg("b2"),
        py::arg("eps"), py::arg("wd"), py::arg("bias_correction"), py::arg("bc1_t"),
        py::arg("bc2_t"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
        py::arg("sqrt") = "ieee", py::arg("g_types") = std::vector<DType>{},
        py::arg("v_is_denom") = false, py::arg("accs") = std::vector<uintptr_t>{}, doc);
  };
  def_steps("onebit_local_steps", K::AdamRule::kOneBitLocal,
            "onebit_local_step over a list of tensors given as data pointers (fp32 w, m, v; g of "
            "g_types: fp32, fp16 or bf16, empty for all fp32; outs: optional parameter copies of "
            "out_types, 0 for none) in one call, the GIL released once. The pointers are not "
            "checked beyond null: the caller validates the tensors "
            "(compcomm.optim.cpu_adam.onebit_local_steps_). v_is_denom: vs hold the frozen "
            "denominators functional.adam_denom(v, group, bc2_t), used as they are.");
  def_steps("zero_one_local_steps", K::AdamRule::kZeroOneLocal,
            "0/1 Adam's local step (functional.zero_one_local_multi_ with a frozen variance and "
            "accumulators) over a list of tensors given as data pointers: arguments as "
            "onebit_local_steps, and accs (fp32, one per tensor, required) receive the step too. "
            "The pointers are not checked beyond null: the caller validates the tensors "
            "(compcomm.optim.cpu_multi.zero_one_local_steps_).");
  def_steps("onebit_warmup_steps", K::AdamRule::kOneBitWarmup,
            "onebit_warmup_step over a list of tensors given as data pointers (fp32 w, m, v; g "
            "and outs as onebit_local_steps) in one call, the GIL released once. The pointers are not "
            "checked beyond null: the caller validates the tensors "
            "(compcomm.optim.cpu_multi.onebit_warmup_steps_).");
  def_steps("onebit_compressed_steps", K::AdamRule::kOneBitCompressed,
            "onebit_compressed_step (no mask) over a list of tensors given as data pointers (fp32 "
            "w, m, v, averaged as gs; outs and v_is_denom as onebit_local_steps) in one call, the "
            "GIL released once. The pointers are not checked beyond null: the caller validates "
            "the tensors (compcomm.optim.cpu_multi.onebit_compressed_steps_).");

  m.def(
      "onebit_momentums",
      [](const std::vector<int64_t>& numels, const std::vector<uintptr_t>& ms,
         const std::vector<uintptr_t>& gs, const std::vector<uintptr_t>& outs, double b1,
         int num_threads, const std::string& isa) {
        const char* fn = "onebit_momentums";
        const size_t k = numels.size();
        if (ms.size() != k || gs.size() != k || outs.size() != k)
          value_error(concat(fn, ": ms, gs and outs must hold ", k, " pointers (one per numel)"));
        if (num_threads < 0) value_error(concat(fn, ": num_threads must be >= 0, got ", num_threads));
        const K::AdamIsa which = isa_of(isa);
        if (!K::adam_isa_supported(which))
          value_error(concat(fn, ": isa '", isa, "' is not available on this machine or in this build"));
        for (size_t i = 0; i < k; ++i) {
          if (numels[i] < 0) value_error(concat(fn, ": numels[", i, "] is negative"));
          if (numels[i] > 0 && (!ms[i] || !gs[i] || !outs[i]))
            value_error(concat(fn, ": a null pointer for tensor ", i));
        }
        const K::AdamCoeffs c =
            K::onebit_coeffs(K::AdamRule::kOneBitLocal, 0.0, b1, 0.0, 0.0, 0.0, false, 0, 0);
        bool ok = true;
        {
          py::gil_scoped_release release;
          for (size_t i = 0; i < k && ok; ++i)
            ok = K::onebit_momentum(c, reinterpret_cast<const float*>(ms[i]),
                                    reinterpret_cast<const float*>(gs[i]),
                                    reinterpret_cast<float*>(outs[i]), numels[i], num_threads,
                                    which) == kernels::Status::kSuccess;
        }
        if (!ok) value_error(concat(fn, ": the kernel rejected its arguments"));
      },
      py::arg("numels"), py::arg("ms"), py::arg("gs"), py::arg("outs"), py::arg("b1"),
      py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "onebit_momentum over lists of fp32 tensors given as data pointers (out i may be m i) in one "
      "call, the GIL released once. The pointers are not checked beyond null: the caller validates "
      "the tensors (compcomm.optim.cpu_multi.onebit_momentums_).");

  m.def(
      "onebit_momentum",
      [](const Buffer& m_, const Buffer& g, const Buffer& out, double b1, int num_threads,
         const std::string& isa) {
        const char* fn = "onebit_momentum";
        const K::AdamIsa which = isa_of(isa);
        if (!K::adam_isa_supported(which))
          value_error(concat(fn, ": isa '", isa, "' is not available on this machine or in this build"));
        float_type(fn, "m", m_, false);
        float_type(fn, "g", g, false);
        float_type(fn, "out", out, false);
        check_buffer(fn, "m", m_, m_.count, "m");
        check_buffer(fn, "g", g, m_.count, "m");
        check_buffer(fn, "out", out, m_.count, "m");
        check_aliasing(fn, {{"out", &out}}, {{"m", &m_}, {"g", &g}});
        if (num_threads < 0) value_error(concat(fn, ": num_threads must be >= 0, got ", num_threads));
        const K::AdamCoeffs c =
            K::onebit_coeffs(K::AdamRule::kOneBitLocal, 0.0, b1, 0.0, 0.0, 0.0, false, 0, 0);
        kernels::Status s;
        {
          py::gil_scoped_release release;
          s = K::onebit_momentum(c, static_cast<const float*>(m_.data),
                                 static_cast<const float*>(g.data), static_cast<float*>(out.data),
                                 m_.count, num_threads, which);
        }
        if (s != kernels::Status::kSuccess) value_error(concat(fn, ": the kernel rejected its arguments"));
      },
      py::arg("m"), py::arg("g"), py::arg("out"), py::arg("b1"), py::arg("num_threads") = 0,
      py::arg("isa") = "auto",
      "out = b1 m + (1-b1) g (fp32), bit for bit functional.onebit_momentum: 1-bit Adam's local "
      "momentum, the tensor a rank compresses; out may be m itself.");

  m.def(
      "all_finite",
      [](const std::vector<Buffer>& xs, const std::string& isa) {
        const K::AdamIsa which = isa_of(isa);
        if (!K::adam_isa_supported(which))
          value_error(concat("all_finite: isa '", isa,
                             "' is not available on this machine or in this build"));
        for (size_t i = 0; i < xs.size(); ++i) {
          const std::string name = concat("xs[", i, "]");
          float_type("all_finite", name.c_str(), xs[i], false);
          check_buffer("all_finite", name.c_str(), xs[i], xs[i].count);
        }
        bool finite = true;
        kernels::Status s = kernels::Status::kSuccess;
        {
          py::gil_scoped_release release;
          for (size_t i = 0; i < xs.size() && finite && s == kernels::Status::kSuccess; ++i)
            s = K::adam_all_finite(static_cast<const float*>(xs[i].data), xs[i].count, &finite, which);
        }
        // a failed kernel raises: it must not read as "not finite, skip the step"
        if (s != kernels::Status::kSuccess) value_error("all_finite: the kernel rejected its arguments");
        return finite;
      },
      py::arg("xs"), py::arg("isa") = "auto",
      "Whether every value of the fp32 host buffers xs is finite (no Inf, no NaN): one read-only "
      "pass, stopping at the first buffer that is not.");

  m.def(
      "all_finite_ptrs",
      [](const std::vector<int64_t>& numels, const std::vector<uintptr_t>& ptrs,
         const std::string& isa, const std::vector<DType>& dtypes) {
        const char* fn = "all_finite_ptrs";
        if (ptrs.size() != numels.size())
          value_error(concat(fn, ": ptrs must hold ", numels.size(), " pointers (one per numel)"));
        if (!dtypes.empty() && dtypes.size() != numels.size())
          value_error(concat(fn, ": dtypes must be empty (all float32) or hold ", numels.size(),
                             " entries"));
        std::vector<kernels::InputType> types(numels.size(), kernels::InputType::kFloat32);
        for (size_t i = 0; i < dtypes.size(); ++i) {
          if (dtypes[i] == DType::kFloat16)
            types[i] = kernels::InputType::kFloat16;
          else if (dtypes[i] == DType::kBFloat16)
            types[i] = kernels::InputType::kBFloat16;
          else if (dtypes[i] != DType::kFloat32)
            type_error(concat(fn, ": dtypes[", i, "] must be float32, float16 or bfloat16"));
        }
        const K::AdamIsa which = isa_of(isa);
        if (!K::adam_isa_supported(which))
          value_error(
              concat(fn, ": isa '", isa, "' is not available on this machine or in this build"));
        for (size_t i = 0; i < numels.size(); ++i) {
          if (numels[i] < 0) value_error(concat(fn, ": numels[", i, "] is negative"));
          if (numels[i] > 0 && !ptrs[i]) value_error(concat(fn, ": a null pointer for tensor ", i));
        }
        bool finite = true;
        kernels::Status s = kernels::Status::kSuccess;
        {
          py::gil_scoped_release release;
          for (size_t i = 0; i < numels.size() && finite && s == kernels::Status::kSuccess; ++i)
            s = types[i] == kernels::InputType::kFloat32
                    ? K::adam_all_finite(reinterpret_cast<const float*>(ptrs[i]), numels[i],
                                         &finite, which)
                    : K::adam_all_finite_16(reinterpret_cast<const uint16_t*>(ptrs[i]), numels[i],
                                            types[i], &finite);
        }
        // a failed kernel raises: it must not read as "not finite, skip the step"
        if (s != kernels::Status::kSuccess)
          value_error(concat(fn, ": the kernel rejected its arguments"));
        return finite;
      },
      py::arg("numels"), py::arg("ptrs"), py::arg("isa") = "auto",
      py::arg("dtypes") = std::vector<DType>{},
      "all_finite over host arrays given as data pointers and element counts (one call, no "
      "Buffer per tensor); dtypes: one per array (float32, float16, bfloat16; a 16-bit array is "
      "checked in its own dtype, 2 bytes per element), empty for all float32. The pointers are not "
      "checked beyond null: the caller validates the tensors (compcomm.optim.cpu_adam.all_finite, "
      "compcomm.compress.all_finite).");

  m.def(
      "sqrt",
      [](const Buffer& x, const Buffer& out, const std::string& sqrt, const std::string& isa) {
        float_type("sqrt", "x", x, false);
        float_type("sqrt", "out", out, false);
        check_buffer("sqrt", "x", x, x.count, "x");
        check_buffer("sqrt", "out", out, x.count, "x");
        const K::SqrtMode mode = sqrt_of(sqrt);
        const K::AdamIsa which = isa_of(isa);
        if (!K::adam_isa_supported(which))
          value_error(
              concat("sqrt: isa '", isa, "' is not available on this machine or in this build"));
        kernels::Status s;
        {
          py::gil_scoped_release release;
          s = K::adam_sqrt(static_cast<const float*>(x.data), static_cast<float*>(out.data),
                           x.count, mode, which);
        }
        if (s != kernels::Status::kSuccess) value_error("sqrt: the kernel rejected its arguments");
      },
      py::arg("x"), py::arg("out"), py::arg("sqrt") = "ieee", py::arg("isa") = "auto",
      "out = the square root of x (fp32) as the update computes it: 'ieee' (correctly rounded) or "
      "'rsqrt14' (torch's CPU sqrt through MKL on AVX-512 machines, see cpp/kernels/cpu_adam.h).");

  m.def(
      "isa", [] { return isa_name(K::adam_best_isa()); },
      "The instruction set the kernels use on this machine: 'avx512', 'avx2' or 'generic'.");
  m.def(
      "isa_supported", [](const std::string& isa) { return K::adam_isa_supported(isa_of(isa)); },
      py::arg("isa"), "Whether isa ('generic', 'avx2', 'avx512') can run here.");
  m.def(
      "threading", [] { return std::string(K::adam_threading()); },
      "How the kernels use threads: 'openmp' or 'std::thread'.");
  bind_optim_lamb(m);
}
