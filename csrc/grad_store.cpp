#include "grad_store.h"

#include <c10/util/Exception.h>
#include <c10/util/irange.h>

#include <unordered_set>

namespace vflow {

namespace {

// Post hook on one parameter's AccumulateGrad node (Note [Capturing gradients]). It
// holds the store weakly: a backward that outlives the store finds nothing to feed.
class CaptureHook : public torch::autograd::FunctionPostHook {
 public:
  CaptureHook(std::weak_ptr<GradStore> store, int64_t buffer, int64_t slot)
      : store_(std::move(store)), buffer_(buffer), slot_(slot) {}

  torch::autograd::variable_list operator()(
      const torch::autograd::variable_list& outputs,
      const torch::autograd::variable_list& /*inputs*/) override {
    if (auto store = store_.lock()) {
      store->on_gradient(buffer_, slot_);
    }
    return outputs;
  }

 private:
  std::weak_ptr<GradStore> store_;
  int64_t buffer_;
  int64_t slot_;
};

} // namespace

GradStore::GradStore(const std::vector<std::vector<at::Tensor>>& groups,
                     const std::vector<at::ScalarType>& dtypes) {
  TORCH_CHECK(!groups.empty(), "groups must hold at least one parameter group");
  TORCH_CHECK(groups.size() == dtypes.size(), "dtypes has ", dtypes.size(),
              " entries but groups has ", groups.size(), "; give one dtype per group");
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto b : c10::irange(groups.size())) {
    const auto& members = groups[b];
    TORCH_CHECK(!members.empty(), "groups[", b, "] is empty");
    for (const auto s : c10::irange(members.size())) {
      const at::Tensor& p = members[s];
      TORCH_CHECK(p.defined(), "groups[", b, "][", s, "] is undefined");
      TORCH_CHECK(p.requires_grad() && p.is_leaf(), "groups[", b, "][", s,
                  "] must be a leaf tensor that requires grad");
      TORCH_CHECK(p.scalar_type() == members[0].scalar_type(), "groups[", b, "][", s,
                  "] is ", p.scalar_type(), " but groups[", b, "][0] is ",
                  members[0].scalar_type(), "; one dtype per group");
      TORCH_CHECK(seen.insert(p.unsafeGetTensorImpl()).second, "groups[", b, "][", s,
                  "] appears twice; each parameter belongs to one slot");
    }
    auto buffer = std::make_shared<GradBuffer>(members, dtypes[b]);
    if (members[0].scalar_type() == dtypes[b]) {
      mirrors_.emplace_back();
      mirror_views_.emplace_back();
    } else {
      mirrors_.push_back(
          at::zeros_like(buffer->data(), buffer->data().options().dtype(members[0].scalar_type())));
      mirror_views_.push_back(buffer->views_of(mirrors_.back()));
    }
    std::vector<int64_t> index;
    for (const auto s : c10::irange(members.size())) {
      index.push_back(static_cast<int64_t>(params_.size()));
      params_.push_back({members[s], static_cast<int64_t>(b), static_cast<int64_t>(s)});
    }
    param_index_.push_back(std::move(index));
    buffers_.push_back(std::move(buffer));
  }
}

GradStore::~GradStore() {
  remove_hooks();
}

void GradStore::install_hooks() {
  TORCH_CHECK(hooks_.empty(), "GradStore::install_hooks: the hooks are installed already");
  const std::weak_ptr<GradStore> self = weak_from_this();
  TORCH_CHECK(!self.expired(), "GradStore::install_hooks needs a store owned by a shared_ptr");
  hooks_.reserve(params_.size());
  for (const auto& param : params_) {
    // Keeping the node alive keeps it the parameter's accumulator (the variable holds
    // it weakly), as DDP's reducer does.
    auto node = torch::autograd::impl::grad_accumulator(param.tensor);
    TORCH_CHECK(node, "parameter of buffer ", param.buffer, ", slot ", param.slot,
                " has no gradient accumulator");
    const uintptr_t key =
        node->add_post_hook(std::make_unique<CaptureHook>(self, param.buffer, param.slot));
    hooks_.emplace_back(std::move(node), key);
  }
}

void GradStore::remove_hooks() {
  for (auto& [node, key] : hooks_) {
    node->del_post_hook(key);
  }
  hooks_.clear();
}

void GradStore::set_sink(std::shared_ptr<GradSink> sink) {
  TORCH_CHECK(!sink_ || !sink_->accepts(), "GradStore::set_sink called while the current "
              "sink takes gradients");
  sink_ = std::move(sink);
}

void GradStore::on_gradient(int64_t buffer, int64_t slot) {
  if (!sink_ || !sink_->accepts()) {
    return;
  }
  at::Tensor& grad = params_[param_index_[buffer][slot]].tensor.mutable_grad();
  if (!grad.defined()) {
    return;
  }
  at::Tensor taken = std::move(grad);
  grad.reset();
  sink_->receive_grad(buffer, slot, taken);
}

void GradStore::detach_grads() {
  for (auto& param : params_) {
    param.tensor.mutable_grad().reset();
  }
}

void GradStore::publish() {
  for (const auto b : c10::irange(buffers_.size())) {
    const GradBuffer& buffer = *buffers_[b];
    if (mirrors_[b].defined()) {
      mirrors_[b].copy_(buffer.data());
    }
    const auto& views = mirrors_[b].defined() ? mirror_views_[b] : buffer.views();
    for (const auto s : c10::irange(views.size())) {
      params_[param_index_[b][s]].tensor.mutable_grad() = views[s];
    }
  }
}

} // namespace vflow
