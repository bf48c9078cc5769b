// Python bindings of vflow._C. The stateful GradBuffer is the main object; the
// stateless kernels are PyTorch operators instead (torch_ops.cpp, vflow/ops.py).
#include <torch/extension.h>

#include "collectives.h"
#include "exact.h"
#include "grad_buffer.h"
#include "grad_store.h"
#include "interrupt.h"
#include "ops.h"
#include "reducer.h"

#include <optional>
#include <tuple>

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

  // Note [Interrupting a wait] in interrupt.cpp.
  m.def("interrupt_group", &vflow::interrupt_group, py::arg("group"),
        "From any thread: every wait on the group's collectives ends at once.");
  m.def("group_interrupted", &vflow::group_interrupted, py::arg("group"));
  m.def("group_busy", &vflow::group_busy, py::arg("group"),
        "Whether a collective an interrupted wait left behind still runs.");

  using vflow::Reducer;
  py::register_exception<vflow::CollectiveError>(m, "CollectiveError", PyExc_RuntimeError);
  py::class_<Reducer::BucketRange>(m, "BucketRange")
      .def_readonly("buffer", &Reducer::BucketRange::buffer)
      .def_readonly("first_slot", &Reducer::BucketRange::first_slot)
      .def_readonly("last_slot", &Reducer::BucketRange::last_slot)
      .def_readonly("offset", &Reducer::BucketRange::offset)
      .def_readonly("numel", &Reducer::BucketRange::numel);

  // Note [Gradient store and reducer] in csrc/grad_store.h.
  py::class_<vflow::GradSink, std::shared_ptr<vflow::GradSink>>(m, "GradSink");
  py::class_<vflow::GradStore, std::shared_ptr<vflow::GradStore>>(m, "GradStore")
      .def(py::init([](const std::vector<std::vector<at::Tensor>>& groups,
                       const std::vector<at::ScalarType>& dtypes) {
             auto store = std::make_shared<vflow::GradStore>(groups, dtypes);
             store->install_hooks();
             return store;
           }),
           py::arg("groups"), py::arg("dtypes"))
      .def_property_readonly("buffers", &vflow::GradStore::buffers)
      .def_property_readonly("num_params", &vflow::GradStore::num_params)
      .def("set_sink", &vflow::GradStore::set_sink, py::arg("sink"))
      .def("detach_grads", &vflow::GradStore::detach_grads)
      .def("publish", &vflow::GradStore::publish)
      .def("remove_hooks", &vflow::GradStore::remove_hooks);

  // Note [Reduction strategies] in csrc/reduction/reduction.h.
  py::class_<vflow::Reduction, std::shared_ptr<vflow::Reduction>>(m, "Reduction")
      .def_property_readonly("kind", &vflow::Reduction::kind);
  py::class_<vflow::AllReduceSum, vflow::Reduction, std::shared_ptr<vflow::AllReduceSum>>(
      m, "AllReduceSum")
      .def(py::init<>());
  py::class_<vflow::OrderedSum, vflow::Reduction, std::shared_ptr<vflow::OrderedSum>>(
      m, "OrderedSum")
      .def(py::init<>())
      .def("set_tree", &vflow::OrderedSum::set_tree, py::arg("cover_counts"),
           py::arg("combine_merges"));
  py::class_<vflow::ExactSum, vflow::Reduction, std::shared_ptr<vflow::ExactSum>>(m, "ExactSum")
      .def(py::init<>());

  // Calls that may start or wait for a collective release the GIL: a backend thread
  // that drops a finished collective's last tensor reference may need it. The hooks
  // feeding add_grad are C++ and run on autograd's threads without the GIL.
  using ProcessGroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;
  py::class_<Reducer, vflow::GradSink, std::shared_ptr<Reducer>>(m, "Reducer")
      .def(py::init([](const std::vector<std::shared_ptr<vflow::GradBuffer>>& buffers,
                       const std::vector<std::tuple<int64_t, int64_t, int64_t>>& buckets,
                       std::shared_ptr<vflow::Reduction> reduction,
                       std::optional<ProcessGroupPtr> process_group, double timeout_seconds,
                       std::string description) {
             std::vector<Reducer::BucketSpec> specs;
             specs.reserve(buckets.size());
             for (const auto& [buffer, first, last] : buckets) {
               specs.push_back({buffer, first, last});
             }
             return std::make_shared<Reducer>(
                 buffers, specs, std::move(reduction), process_group.value_or(ProcessGroupPtr()),
                 vflow::timeout_from_seconds(timeout_seconds), std::move(description));
           }),
           py::arg("buffers"), py::arg("buckets"), py::arg("reduction"),
           py::arg("process_group") = py::none(), py::arg("timeout_seconds") = 600.0,
           py::arg("description") = "the process group")
      .def(
          "set_group",
          [](Reducer& self, std::optional<ProcessGroupPtr> process_group, double timeout_seconds,
             std::string description) {
            self.set_group(process_group.value_or(ProcessGroupPtr()),
                           vflow::timeout_from_seconds(timeout_seconds), std::move(description));
          },
          py::arg("process_group"), py::arg("timeout_seconds"), py::arg("description"))
      .def_property_readonly("buffers", &Reducer::buffers)
      .def_property_readonly("reduction", &Reducer::reduction)
      .def_property_readonly("num_buckets", &Reducer::num_buckets)
      .def_property_readonly("world_size", &Reducer::world_size)
      .def_property_readonly("rank", &Reducer::rank)
      .def_property_readonly("in_step", &Reducer::in_step)
      .def_property_readonly("bytes_per_step", &Reducer::bytes_per_step)
      .def("bucket_of", &Reducer::bucket_of, py::arg("buffer"), py::arg("slot"))
      .def("bucket_ranges", &Reducer::bucket_ranges)
      .def("begin_step", &Reducer::begin_step, py::arg("step"))
      .def("begin_vn", &Reducer::begin_vn, py::arg("weight"), py::arg("last"),
           py::arg("level") = 0, py::arg("merges") = 0)
      .def("add_grad", &Reducer::add_grad, py::arg("bucket"), py::arg("slot"), py::arg("grad"),
           py::call_guard<py::gil_scoped_release>())
      .def("end_vn", &Reducer::end_vn, py::call_guard<py::gil_scoped_release>())
      .def("abort_vn", &Reducer::abort_vn, py::call_guard<py::gil_scoped_release>())
      .def("start_stats", &Reducer::start_stats, py::arg("stats"),
           py::arg("with_buckets") = false, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("stats_with_buckets", &Reducer::stats_with_buckets)
      .def("wait_stats", &Reducer::wait_stats, py::call_guard<py::gil_scoped_release>())
      .def("finalize", &Reducer::finalize, py::arg("factor"), py::arg("found_nonfinite"),
           py::call_guard<py::gil_scoped_release>())
      .def("discard", &Reducer::discard, py::call_guard<py::gil_scoped_release>())
      .def("reduce_as_is", &Reducer::reduce_as_is, py::arg("step"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("last_wait_seconds", &Reducer::last_wait_seconds)
      .def_property_readonly("comm_failure", &Reducer::comm_failure)
      .def_property_readonly("early_launches", &Reducer::early_launches);
}
