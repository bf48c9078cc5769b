// Python bindings of vflow._C. The stateful GradBuffer is the main object; the
// stateless kernels are PyTorch operators instead (torch_ops.cpp, vflow/ops.py).
#include <torch/extension.h>

#include "collectives.h"
#include "exact.h"
#include "grad_buffer.h"
#include "ops.h"
#include "reducer.h"

#include <optional>

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
  m.def("cpu_vector_paths", &vflow::cpu_vector_paths,
        "The CPU kernels' vector paths this CPU and build offer, best first.");
  // The stateless kernels are torch.ops.vflow.* (Note [One op surface]; vflow.ops).
  m.attr("EXACT_MAX_TERMS") = vflow::exact::kMaxTerms;

  py::class_<vflow::GradBuffer, std::shared_ptr<vflow::GradBuffer>>(m, "GradBuffer")
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

  // Note [Collectives on tensors Python cannot see]. The GIL is released while they
  // wait, as for the Reducer below.
  m.def("all_reduce_sum_", &vflow::all_reduce_sum_, py::arg("group"), py::arg("tensors"),
        py::arg("device"), py::arg("timeout_seconds"),
        py::call_guard<py::gil_scoped_release>(),
        "In place: each tensor becomes its elementwise sum over the group.");
  m.def("broadcast_", &vflow::broadcast_, py::arg("group"), py::arg("tensors"),
        py::arg("device"), py::arg("root"), py::arg("timeout_seconds"),
        py::call_guard<py::gil_scoped_release>(),
        "In place: the tensors become group rank root's.");
  m.def("all_gather_into", &vflow::all_gather_into, py::arg("group"), py::arg("input"),
        py::arg("outputs"), py::arg("timeout_seconds"),
        py::call_guard<py::gil_scoped_release>(),
        "outputs[r] becomes group rank r's input.");

  using vflow::Reducer;
  py::register_exception<vflow::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  py::class_<Reducer::BucketRange>(m, "BucketRange")
      .def_readonly("buffer", &Reducer::BucketRange::buffer)
      .def_readonly("first_slot", &Reducer::BucketRange::first_slot)
      .def_readonly("last_slot", &Reducer::BucketRange::last_slot)
      .def_readonly("offset", &Reducer::BucketRange::offset)
      .def_readonly("numel", &Reducer::BucketRange::numel);

  // Every call that may start or wait for a collective releases the GIL. Holding it
  // while enqueueing deadlocks: a backend worker thread that drops the last reference
  // to a finished collective's tensor must take the GIL to free that tensor's Python
  // object, and it does so while holding the lock that enqueueing needs. The hooks
  // call add_grad from Python, so the release happens here rather than in the hook.
  py::class_<Reducer>(m, "Reducer")
      .def(py::init([](const std::vector<std::vector<at::Tensor>>& groups,
                       const std::vector<at::ScalarType>& dtypes, int64_t first_bucket_bytes,
                       int64_t bucket_cap_bytes,
                       std::optional<c10::intrusive_ptr<c10d::ProcessGroup>> process_group,
                       double timeout_seconds, std::string description, bool exact,
                       bool ordered) {
             const auto timeout = vflow::timeout_from_seconds(timeout_seconds);
             return std::make_unique<Reducer>(
                 groups, dtypes, first_bucket_bytes, bucket_cap_bytes,
                 process_group.value_or(c10::intrusive_ptr<c10d::ProcessGroup>()), timeout,
                 std::move(description), exact, ordered);
           }),
           py::arg("groups"), py::arg("dtypes"), py::arg("first_bucket_bytes"),
           py::arg("bucket_cap_bytes"), py::arg("process_group") = py::none(),
           py::arg("timeout_seconds") = 600.0, py::arg("description") = "the process group",
           py::arg("exact") = false, py::arg("ordered") = false)
      .def_property_readonly("buffers", &Reducer::buffers)
      .def_property_readonly("num_buckets", &Reducer::num_buckets)
      .def_property_readonly("world_size", &Reducer::world_size)
      .def_property_readonly("exact", &Reducer::exact)
      .def_property_readonly("ordered", &Reducer::ordered)
      .def_property_readonly("bytes_per_step", &Reducer::bytes_per_step)
      .def("bucket_of", &Reducer::bucket_of, py::arg("buffer"), py::arg("slot"))
      .def("bucket_ranges", &Reducer::bucket_ranges)
      .def("begin_step", &Reducer::begin_step, py::arg("step"))
      .def("set_tree", &Reducer::set_tree, py::arg("cover_counts"), py::arg("combine_merges"))
      .def("begin_vn", &Reducer::begin_vn, py::arg("weight"), py::arg("last"),
           py::arg("level") = 0, py::arg("merges") = 0)
      .def("add_grad", &Reducer::add_grad, py::arg("bucket"), py::arg("slot"), py::arg("grad"),
           py::call_guard<py::gil_scoped_release>())
      .def("end_vn", &Reducer::end_vn,
           py::call_guard<py::gil_scoped_release>())
      .def("abort_vn", &Reducer::abort_vn,
           py::call_guard<py::gil_scoped_release>())
      .def("start_stats", &Reducer::start_stats, py::arg("stats"),
           py::call_guard<py::gil_scoped_release>())
      .def("wait_stats", &Reducer::wait_stats, py::call_guard<py::gil_scoped_release>())
      .def("finalize", &Reducer::finalize, py::arg("factor"), py::arg("found_nonfinite"),
           py::call_guard<py::gil_scoped_release>())
      .def("discard", &Reducer::discard, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("last_wait_seconds", &Reducer::last_wait_seconds)
      .def_property_readonly("early_launches", &Reducer::early_launches);
}
