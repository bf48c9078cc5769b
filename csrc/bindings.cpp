// Python bindings of vflow._C. The stateful GradBuffer is the main object; the
// stateless kernels are exposed too, for tests and benchmarks that measure them
// against PyTorch baselines without a buffer in the way.
#include <torch/extension.h>

#include "grad_buffer.h"
#include "ops.h"

#ifndef VFLOW_TORCH_VERSION
#define VFLOW_TORCH_VERSION "unknown"
#endif

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vflow C++/CUDA kernels: fused gradient accumulation buffers";
  m.attr("torch_version") = VFLOW_TORCH_VERSION;
  m.def("built_with_cuda", &vflow::built_with_cuda,
        "True when the CUDA kernels were compiled into this build.");
  m.def("set_cpu_vector_path", &vflow::set_cpu_vector_path, py::arg("name"),
        "Select the CPU kernels' vector path: 'avx2' or 'portable'.");
  m.def("cpu_vector_path", &vflow::cpu_vector_path);
  m.def("multi_accumulate_", &vflow::multi_accumulate_, py::arg("accs"), py::arg("grads"),
        py::arg("weight"), py::arg("overwrite") = false,
        "accs[i] += weight * grads[i] (= with overwrite) for every i, in one fused call.");
  m.def("scale_", &vflow::scale_, py::arg("buf"), py::arg("factor"),
        "buf *= factor in one pass (float32/float64, contiguous).");
  m.def("scale_check_", &vflow::scale_check_, py::arg("buf"), py::arg("factor"),
        py::arg("found_nonfinite"),
        "buf *= factor and set found_nonfinite to 1 if any result is inf/NaN, in one pass.");

  py::class_<vflow::GradBuffer>(m, "GradBuffer")
      .def(py::init<const std::vector<at::Tensor>&, at::ScalarType>(), py::arg("params"),
           py::arg("dtype"))
      .def_property_readonly("data", &vflow::GradBuffer::data)
      .def("views", &vflow::GradBuffer::views)
      .def("views_of", &vflow::GradBuffer::views_of, py::arg("flat"))
      .def("accumulate_", &vflow::GradBuffer::accumulate_, py::arg("indices"),
           py::arg("grads"), py::arg("weight"), py::arg("overwrite") = false)
      .def("zero_slots_", &vflow::GradBuffer::zero_slots_, py::arg("first"), py::arg("last"))
      .def("zero_", &vflow::GradBuffer::zero_)
      .def("scale_", &vflow::GradBuffer::scale_, py::arg("factor"))
      .def("scale_check_", &vflow::GradBuffer::scale_check_, py::arg("factor"),
           py::arg("found_nonfinite"))
      .def_property_readonly("num_slots", &vflow::GradBuffer::num_slots)
      .def_property_readonly("offsets", &vflow::GradBuffer::offsets)
      .def_property_readonly("numels", &vflow::GradBuffer::numels)
      .def("__len__", &vflow::GradBuffer::num_slots);
}
