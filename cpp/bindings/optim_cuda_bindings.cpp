// compcomm._C.optim_cuda: the multi-tensor CUDA kernels of the 1-bit Adam update. Exports only.
// Tensors arrive as parallel lists of device pointers (ints) with one list of element counts, built
// by compcomm.optim._fused from validated contiguous CUDA tensors of one device; here only the
// lists' lengths are checked (the kernels check counts and required pointers). GIL released.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>
#include <vector>

#include "../common.h"
#include "../kernels/optim_kernels.h"

namespace py = pybind11;
using namespace compcomm;

namespace {

using Ptrs = std::vector<uintptr_t>;

void check(kernels::Status s, const char* name) {
  if (s == kernels::Status::kSuccess) return;
  if (s == kernels::Status::kNotBuilt)
    throw Unsupported(std::string(name) + ": this build has no CUDA kernels", name, "cuda", 3, -1);
  if (s == kernels::Status::kInvalidArgument)
    throw InvalidArgument(std::string(name) +
                          ": invalid lists (a negative count, a missing required pointer or a "
                          "low-precision output that is not float16/bfloat16)");
  throw BackendError(std::string(name) + ": CUDA error (kernel launch failed)", name, "cuda",
                     static_cast<int>(s), -1);
}

// The pointers of one list as T* (an empty optional list: nullptr entries, size n).
template <class T>
std::vector<T*> list_of(const Ptrs& p, size_t n, const char* name, bool optional = false) {
  if (optional && p.empty()) return std::vector<T*>(n, nullptr);
  if (p.size() != n)
    throw InvalidArgument(std::string("argument '") + name + "' must hold " + std::to_string(n) +
                          " pointers (one per count), got " + std::to_string(p.size()));
  std::vector<T*> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = reinterpret_cast<T*>(p[i]);
  return out;
}

std::vector<kernels::InputType> types_of(const std::vector<DType>& t, size_t n) {
  if (!t.empty() && t.size() != n)
    throw InvalidArgument("argument 'lowp_types' must be empty or hold one dtype per count");
  std::vector<kernels::InputType> out(n, kernels::InputType::kFloat32);
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == DType::kFloat16) out[i] = kernels::InputType::kFloat16;
    if (t[i] == DType::kBFloat16) out[i] = kernels::InputType::kBFloat16;
  }
  return out;
}

kernels::AdamHyper hyper_of(double lr, double beta1, double beta2, double eps, double weight_decay,
                            bool bias_correction, double bc1, double sqrt_bc2) {
  kernels::AdamHyper h;
  h.lr = lr, h.beta1 = beta1, h.beta2 = beta2, h.eps = eps, h.weight_decay = weight_decay;
  h.bias_correction = bias_correction, h.bc1 = bc1, h.sqrt_bc2 = sqrt_bc2;
  return h;
}

using StepFn = kernels::Status (*)(int, const int64_t*, const float* const*, float* const*,
                                   const float* const*, float* const*, void* const*,
                                   const kernels::InputType*, const kernels::AdamHyper&, const uint8_t*,
                                   kernels::Stream);

}  // namespace

void bind_optim_cuda(py::module_& parent) {
  py::module_ m = parent.def_submodule(
      "optim_cuda",
      "Multi-tensor CUDA kernels of 1-bit Adam's update (lists of device pointers of one device; see "
      "compcomm.optim._fused for the torch-level API).");

  m.def("built", &kernels::cuda::built, "Whether this build has the CUDA kernels.");

  m.def(
      "onebit_momentum",
      [](const std::vector<int64_t>& numels, const Ptrs& out, const Ptrs& mm, const Ptrs& g, double beta1,
         int device, uintptr_t stream) {
        const size_t n = numels.size();
        auto o = list_of<float>(out, n, "out");
        auto a = list_of<const float>(mm, n, "m", true);
        auto gg = list_of<const float>(g, n, "g");
        const kernels::ScopedDevice on(device);
        check(kernels::cuda::onebit_momentum(static_cast<int>(n), numels.data(), o.data(), a.data(), gg.data(),
                                             beta1, reinterpret_cast<kernels::Stream>(stream)),
              "onebit_momentum");
      },
      py::arg("numels"), py::arg("out"), py::arg("m"), py::arg("g"), py::arg("beta1"), py::arg("device"),
      py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "out[i] = m[i]*beta1 + (1-beta1)*g[i] (m empty: zero momentum; out may be m).");

  m.def(
      "finite_gate",
      [](const std::vector<int64_t>& numels, const Ptrs& x, uintptr_t gate, int device, uintptr_t stream) {
        const size_t n = numels.size();
        auto xs = list_of<const float>(x, n, "x");
        if (gate == 0) throw InvalidArgument("argument 'gate' must be the address of a device byte, got 0");
        const kernels::ScopedDevice on(device);
        check(kernels::cuda::finite_gate(static_cast<int>(n), numels.data(), xs.data(),
                                         reinterpret_cast<uint8_t*>(gate),
                                         reinterpret_cast<kernels::Stream>(stream)),
              "finite_gate");
      },
      py::arg("numels"), py::arg("x"), py::arg("gate"), py::arg("device"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "*gate = 1 if every element of the fp32 tensors x is finite, else 0 (queued on stream: a memset "
      "and one read-only multi-tensor pass; no sync).");

  // The three steps share their signature: (numels, x, m, v, w, lowp, lowp_types, hyper..., device,
  // stream, gate).
  auto step = [&m](const char* name, StepFn fn, const char* first, bool first_is_grad, const char* doc) {
    m.def(
        name,
        [name, fn, first_is_grad](const std::vector<int64_t>& numels, const Ptrs& x, const Ptrs& mm,
                                  const Ptrs& v, const Ptrs& w, const Ptrs& lowp,
                                  const std::vector<DType>& lowp_types, double lr, double beta1, double beta2,
                                  double eps, double weight_decay, bool bias_correction, double bc1,
                                  double sqrt_bc2, int device, uintptr_t stream, uintptr_t gate) {
          const size_t n = numels.size();
          auto xs = list_of<const float>(x, n, first_is_grad ? "g" : "a");
          auto ms = list_of<float>(mm, n, "m");
          auto vs = list_of<float>(v, n, "v");
          auto ws = list_of<float>(w, n, "w");
          auto ls = list_of<void>(lowp, n, "lowp", true);
          auto ts = types_of(lowp_types, n);
          const auto h = hyper_of(lr, beta1, beta2, eps, weight_decay, bias_correction, bc1, sqrt_bc2);
          const kernels::ScopedDevice on(device);
          check(fn(static_cast<int>(n), numels.data(), xs.data(), ms.data(), vs.data(), ws.data(), ls.data(),
                   ts.data(), h, reinterpret_cast<const uint8_t*>(gate),
                   reinterpret_cast<kernels::Stream>(stream)),
                name);
        },
        py::arg("numels"), py::arg(first), py::arg("m"), py::arg("v"), py::arg("w"), py::arg("lowp"),
        py::arg("lowp_types"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("bias_correction"), py::arg("bc1"), py::arg("sqrt_bc2"),
        py::arg("device"), py::arg("stream") = 0, py::arg("gate") = 0,
        py::call_guard<py::gil_scoped_release>(), doc);
  };
  step("onebit_compressed_step",
       [](int c, const int64_t* n, const float* const* a, float* const* mm, const float* const* v,
          float* const* w, void* const* l, const kernels::InputType* t, const kernels::AdamHyper& h,
          const uint8_t* gt, kernels::Stream s) {
         return kernels::cuda::onebit_compressed_step(c, n, a, mm, v, w, l, t, h, gt, s);
       },
       "a", false,
       "m = a; w += -lr * (m / (sqrt(v) [/ sqrt_bc2] + eps) [/ bc1] [+ wd*w]); lowp = w rounded (v read "
       "only).");
  step("onebit_local_step",
       [](int c, const int64_t* n, const float* const* g, float* const* mm, const float* const* v,
          float* const* w, void* const* l, const kernels::InputType* t, const kernels::AdamHyper& h,
          const uint8_t* gt, kernels::Stream s) {
         return kernels::cuda::onebit_local_step(c, n, mm, v, g, w, l, t, h, gt, s);
       },
       "g", true,
       "One rank's compressed step: m = m*b1 + (1-b1)*g (onebit_momentum), then the step of "
       "onebit_compressed_step with that m (v read only), one pass.");
  step("adam_warmup_step",
       [](int c, const int64_t* n, const float* const* g, float* const* mm, const float* const* v,
          float* const* w, void* const* l, const kernels::InputType* t, const kernels::AdamHyper& h,
          const uint8_t* gt, kernels::Stream s) {
         return kernels::cuda::adam_warmup_step(c, n, mm, const_cast<float* const*>(v), g, w, l, t, h, gt,
                                                s);
       },
       "g", true,
       "m = m*b1 + (1-b1)*g; v = v*b2 + ((1-b2)*g)*g; then the step of onebit_compressed_step.");

  // 1-bit LAMB's passes (cpp/kernels/cpu_lamb.h; c: compcomm._C.optim.LambCoeffs)
  using LambCoeffs = kernels::cpu::LambCoeffs;
  m.def(
      "lamb_partials",
      [](const std::vector<int64_t>& numels) {
        return kernels::cuda::lamb_partials(static_cast<int>(numels.size()), numels.data());
      },
      py::arg("numels"), "The partial results lamb_stats needs room for (3 doubles each).");
  m.def(
      "lamb_momentum",
      [](const LambCoeffs& c, const std::vector<int64_t>& numels, const Ptrs& mm, const Ptrs& g,
         const Ptrs& last, const std::vector<float>& scales, int device, uintptr_t stream) {
        const size_t n = numels.size();
        auto ms = list_of<float>(mm, n, "m");
        auto gs = list_of<const float>(g, n, "g");
        auto ls = list_of<float>(last, n, "last");
        if (scales.size() != n) throw InvalidArgument("argument 'scales' must hold one per count");
        const kernels::ScopedDevice on(device);
        check(kernels::cuda::lamb_momentum(c, static_cast<int>(n), numels.data(), ms.data(),
                                           gs.data(), ls.data(), scales.data(),
                                           reinterpret_cast<kernels::Stream>(stream)),
              "lamb_momentum");
      },
      py::arg("c"), py::arg("numels"), py::arg("m"), py::arg("g"), py::arg("last"),
      py::arg("scales"), py::arg("device"), py::arg("stream") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "last[i] = m[i]; m[i] = (b1 m + (1-b1) g) * scales[i].");
  m.def(
      "lamb_stats",
      [](const LambCoeffs& c, const std::vector<int64_t>& numels, const Ptrs& mm, const Ptrs& last,
         const Ptrs& g, const Ptrs& v, const Ptrs& vf, const Ptrs& w,
         const std::vector<float>& scales, uintptr_t partials, uintptr_t out, int device,
         uintptr_t stream, uintptr_t gate) {
        const size_t n = numels.size();
        if (last.empty() == g.empty())
          throw InvalidArgument("lamb_stats: pass last (after an exchange) or g (one rank)");
        auto ms = list_of<float>(mm, n, "m");
        auto ls = list_of<const float>(last, n, "last", true);
        auto gs = list_of<const float>(g, n, "g", true);
        auto vs = list_of<const float>(v, n, "v");
        auto fs = list_of<float>(vf, n, "v_fresh");
        auto ws = list_of<const float>(w, n, "w");
        if (scales.size() != n) throw InvalidArgument("argument 'scales' must hold one per count");
        const kernels::ScopedDevice on(device);
        check(kernels::cuda::lamb_stats(c, static_cast<int>(n), numels.data(), ms.data(),
                                        last.empty() ? nullptr : ls.data(),
                                        g.empty() ? nullptr : gs.data(), vs.data(), fs.data(),
                                        ws.data(), scales.data(), reinterpret_cast<double*>(partials),
                                        reinterpret_cast<float*>(out),
                                        reinterpret_cast<const uint8_t*>(gate),
                                        reinterpret_cast<kernels::Stream>(stream)),
              "lamb_stats");
      },
      py::arg("c"), py::arg("numels"), py::arg("m"), py::arg("last"), py::arg("g"), py::arg("v"),
      py::arg("v_fresh"), py::arg("w"), py::arg("scales"), py::arg("partials"), py::arg("out"),
      py::arg("device"), py::arg("stream") = 0, py::arg("gate") = 0,
      py::call_guard<py::gil_scoped_release>(),
      "m[i] /= scales[i] (or, with g, the momentum updated), v_fresh[i] updated; out[3 i ..] = "
      "max ratio, ||u||, ||update|| (fp32); partials: lamb_partials(numels) * 3 doubles.");
  m.def(
      "lamb_apply",
      [](const LambCoeffs& c, const std::vector<int64_t>& numels, const Ptrs& mm, const Ptrs& v,
         const Ptrs& w, const std::vector<float>& steps, int device, uintptr_t stream) {
        const size_t n = numels.size();
        auto ms = list_of<const float>(mm, n, "m");
        auto vs = list_of<const float>(v, n, "v");
        auto ws = list_of<float>(w, n, "w");
        if (steps.size() != n) throw InvalidArgument("argument 'steps' must hold one per count");
        const kernels::ScopedDevice on(device);
        check(kernels::cuda::lamb_apply(c, static_cast<int>(n), numels.data(), ms.data(), vs.data(),
                                        ws.data(), steps.data(),
                                        reinterpret_cast<kernels::Stream>(stream)),
              "lamb_apply");
      },
      py::arg("c"), py::arg("numels"), py::arg("m"), py::arg("v"), py::arg("w"), py::arg("steps"),
      py::arg("device"), py::arg("stream") = 0, py::call_guard<py::gil_scoped_release>(),
      "w[i] += update * steps[i] (steps[i] = -lr * coefficient).");
}
