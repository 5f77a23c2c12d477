// compcomm._C.optim: 1-bit LAMB's CPU passes (cpp/kernels/cpu_lamb.h) over lists of host arrays given
// as data pointers and element counts, one crossing into C++ per list. Checked here: list lengths,
// counts, null pointers, threads and isa. The Python layer (compcomm.optim.lamb_passes with
// check=True, or its caller OneBitLamb._kernel_runs) validates the tensors behind the pointers
// (host, fp32, contiguous, sizes).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "../common.h"
#include "../kernels/cpu_lamb.h"

namespace py = pybind11;
using namespace compcomm;
namespace K = compcomm::kernels::cpu;
using compcomm::detail::concat;
using Ptrs = std::vector<uintptr_t>;

namespace compcomm::optim_bindings {
K::AdamIsa isa_of(const std::string& s);   // optim_bindings.cpp
K::SqrtMode sqrt_of(const std::string& s);  // optim_bindings.cpp
}  // namespace compcomm::optim_bindings

namespace {

[[noreturn]] void value_error(const std::string& s) { throw py::value_error(s); }

// The checks every list entry point shares; returns the isa.
K::AdamIsa check_lists(const char* fn, const std::vector<int64_t>& numels,
                       std::initializer_list<std::pair<const char*, const Ptrs*>> lists,
                       size_t scalars, int num_threads, const std::string& isa) {
  const size_t k = numels.size();
  for (const auto& [name, ptrs] : lists)
    if (ptrs->size() != k)
      value_error(concat(fn, ": ", name, " must hold ", k, " pointers (one per numel), got ",
                         ptrs->size()));
  if (scalars != k) value_error(concat(fn, ": one scale or step per numel: ", k, ", got ", scalars));
  for (size_t i = 0; i < k; ++i) {
    if (numels[i] < 0) value_error(concat(fn, ": numels[", i, "] is negative"));
    for (const auto& [name, ptrs] : lists)
      if (numels[i] > 0 && (*ptrs)[i] == 0)
        value_error(concat(fn, ": ", name, "[", i, "] is a null pointer"));
  }
  if (num_threads < 0) value_error(concat(fn, ": num_threads must be >= 0, got ", num_threads));
  const K::AdamIsa which = optim_bindings::isa_of(isa);
  if (!K::adam_isa_supported(which))
    value_error(concat(fn, ": isa '", isa, "' is not available on this machine or in this build"));
  return which;
}

template <class P>
P* ptr(uintptr_t p) {
  return reinterpret_cast<P*>(p);
}

}  // namespace

void bind_optim_lamb(py::module_& m) {
  py::class_<K::LambCoeffs>(m, "LambCoeffs",
                            "The fp32 scalars of one 1-bit LAMB step (cpp/kernels/cpu_lamb.h).")
      .def(py::init([](double b1, double b2, double eps, double wd, bool bias_correction,
                       double bc1, double bc2, bool v_is_sqrt, const std::string& sqrt) {
             // each rounded once from the Python double the torch ops receive
             K::LambCoeffs c;
             c.b1 = static_cast<float>(b1);
             c.c1 = static_cast<float>(1.0 - b1);
             c.b2 = static_cast<float>(b2);
             c.c2 = static_cast<float>(1.0 - b2);
             c.eps = static_cast<float>(eps);
             c.wd = static_cast<float>(wd);
             c.weight_decay = wd > 0.0;
             c.bias_correction = bias_correction;
             c.bc1 = bias_correction ? static_cast<float>(bc1) : 1.f;
             c.bc2 = bias_correction ? static_cast<float>(bc2) : 1.f;
             c.v_is_sqrt = v_is_sqrt;
             c.sqrt = optim_bindings::sqrt_of(sqrt);
             return c;
           }),
           py::arg("b1"), py::arg("b2"), py::arg("eps"), py::arg("wd"), py::arg("bias_correction"),
           py::arg("bc1"), py::arg("bc2"), py::arg("v_is_sqrt"), py::arg("sqrt"),
           "bc1 = 1 - b1**t, bc2 = sqrt(1 - b2**freeze_step) (used with bias_correction); "
           "v_is_sqrt: the v arrays hold sqrt(v); sqrt: 'ieee' or 'rsqrt14'.");

  m.def(
      "lamb_momentums",
      [](const K::LambCoeffs& c, const std::vector<int64_t>& numels, const Ptrs& ms,
         const Ptrs& gs, const Ptrs& lasts, const std::vector<double>& scales, int num_threads,
         const std::string& isa) {
        const char* fn = "lamb_momentums";
        const K::AdamIsa which = check_lists(fn, numels, {{"ms", &ms}, {"gs", &gs}, {"lasts", &lasts}},
                                             scales.size(), num_threads, isa);
        bool ok = true;
        {
          py::gil_scoped_release release;
          for (size_t i = 0; i < numels.size() && ok; ++i)
            ok = K::lamb_momentum(c, static_cast<float>(scales[i]), ptr<float>(ms[i]),
                                  ptr<const float>(gs[i]), ptr<float>(lasts[i]), numels[i],
                                  num_threads, which) == kernels::Status::kSuccess;
        }
        if (!ok) value_error(concat(fn, ": the kernel rejected its arguments"));
      },
      py::arg("c"), py::arg("numels"), py::arg("ms"), py::arg("gs"), py::arg("lasts"),
      py::arg("scales"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "Before the exchange, per array i: lasts[i] = ms[i]; ms[i] = (b1 m + (1-b1) g) * scales[i].");

  m.def(
      "lamb_stats",
      [](const K::LambCoeffs& c, const std::vector<int64_t>& numels, const Ptrs& ms,
         const Ptrs& lasts, const Ptrs& vs, const Ptrs& vfs, const Ptrs& ws,
         const std::vector<double>& scales, int num_threads, const std::string& isa,
         const Ptrs& gs) {
        const char* fn = "lamb_stats";
        const bool local = !gs.empty();
        if (local && !lasts.empty()) value_error(concat(fn, ": pass lasts or gs, not both"));
        const K::AdamIsa which = check_lists(
            fn, numels,
            {{"ms", &ms}, local ? std::pair{"gs", &gs} : std::pair{"lasts", &lasts}, {"vs", &vs},
             {"vfs", &vfs}, {"ws", &ws}},
            scales.size(), num_threads, isa);
        std::vector<K::LambStats> out(numels.size());
        bool ok = true;
        {
          py::gil_scoped_release release;
          for (size_t i = 0; i < numels.size() && ok; ++i) {
            K::LambTensors t;
            t.m = ptr<float>(ms[i]);
            if (local)
              t.g = ptr<const float>(gs[i]);
            else
              t.last = ptr<const float>(lasts[i]);
            t.v = ptr<const float>(vs[i]);
            t.vf = ptr<float>(vfs[i]);
            t.w = ptr<float>(ws[i]);
            ok = K::lamb_stats(c, static_cast<float>(scales[i]), t, numels[i], &out[i],
                               num_threads, which) == kernels::Status::kSuccess;
          }
        }
        if (!ok) value_error(concat(fn, ": the kernel rejected its arguments"));
        std::vector<std::tuple<double, double, double>> res;
        res.reserve(out.size());
        // the norms rounded to fp32, as torch's norms of fp32 tensors are
        for (const auto& s : out)
          res.emplace_back(s.max_ratio, static_cast<float>(std::sqrt(s.u_sq)),
                           static_cast<float>(std::sqrt(s.update_sq)));
        return res;
      },
      py::arg("c"), py::arg("numels"), py::arg("ms"), py::arg("lasts"), py::arg("vs"),
      py::arg("vfs"), py::arg("ws"), py::arg("scales"), py::arg("num_threads") = 0,
      py::arg("isa") = "auto", py::arg("gs") = Ptrs{},
      "After the exchange, per array i: ms[i] /= scales[i], the fresh variance vfs[i] updated, and "
      "(max ratio, ||u||, ||update||) returned, the norms from fp64 sums rounded to fp32 "
      "(cpp/kernels/cpu_lamb.h). gs (with lasts empty): a world of one rank, the momentum "
      "update of lamb_momentums done in this pass.");

  m.def(
      "lamb_applies",
      [](const K::LambCoeffs& c, const std::vector<int64_t>& numels, const Ptrs& ms,
         const Ptrs& vs, const Ptrs& ws, const std::vector<double>& neg_steps, int num_threads,
         const std::string& isa) {
        const char* fn = "lamb_applies";
        const K::AdamIsa which = check_lists(fn, numels, {{"ms", &ms}, {"vs", &vs}, {"ws", &ws}},
                                             neg_steps.size(), num_threads, isa);
        bool ok = true;
        {
          py::gil_scoped_release release;
          for (size_t i = 0; i < numels.size() && ok; ++i) {
            K::LambTensors t;
            t.m = ptr<float>(ms[i]);
            t.v = ptr<const float>(vs[i]);
            t.w = ptr<float>(ws[i]);
            ok = K::lamb_apply(c, static_cast<float>(neg_steps[i]), t, numels[i], num_threads,
                               which) == kernels::Status::kSuccess;
          }
        }
        if (!ok) value_error(concat(fn, ": the kernel rejected its arguments"));
      },
      py::arg("c"), py::arg("numels"), py::arg("ms"), py::arg("vs"), py::arg("ws"),
      py::arg("neg_steps"), py::arg("num_threads") = 0, py::arg("isa") = "auto",
      "Per array i: ws[i] += update * neg_steps[i] (neg_steps[i] = -lr * coefficient).");
}
