// See backend_support.h.
#include "backend_support.h"

#include "../dense_values.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <sstream>
#include <utility>

namespace accel::backend {
namespace {


// A Work whose collective has finished, carrying its outputs the way gloo's works do (DDP's reducer and the comm
// hooks read the future's value: the tensors for all_reduce, the list of lists for a list all_gather).
class FinishedWork final : public c10d::Work {
 public:
  FinishedWork(int rank, OpType type, std::vector<at::Tensor> result, c10::IValue value, c10::TypePtr value_type)
      : c10d::Work(rank, type),
        result_(std::move(result)),
        future_(c10::make_intrusive<c10::ivalue::Future>(std::move(value_type))) {
    future_->markCompleted(std::move(value));
    finish();
  }

  std::vector<at::Tensor> result() override { return result_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

// torch's name of a dtype (torch.float32 prints as float32), for the dtypes a collective commonly moves.
std::string dtype_name(int64_t code) {
  if (code < 0 || code >= static_cast<int64_t>(at::ScalarType::Undefined)) return "dtype " + std::to_string(code);
  switch (static_cast<at::ScalarType>(code)) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kShort: return "int16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return c10::toString(static_cast<at::ScalarType>(code));
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Work> finished(int rank, OpType type, const std::vector<at::Tensor>& tensors) {
  return c10::make_intrusive<FinishedWork>(rank, type, tensors, c10::IValue(tensors),
                                           c10::ListType::create(c10::TensorType::get()));
}

c10::intrusive_ptr<c10d::Work> finished(int rank, OpType type, const std::vector<std::vector<at::Tensor>>& lists) {
  c10::List<c10::List<at::Tensor>> value;
  std::vector<at::Tensor> flat;
  for (const auto& list : lists) {
    value.push_back(c10::List<at::Tensor>(list));
    flat.insert(flat.end(), list.begin(), list.end());
  }
  return c10::make_intrusive<FinishedWork>(rank, type, std::move(flat), c10::IValue(value),
                                           c10::ListType::create(c10::ListType::create(c10::TensorType::get())));
}

// --- calls as the core sees them -------------------------------------------------------------------------------

// ReduceKind numbers the reductions as torch.distributed's ReduceOp does, and the Call carries it as its op.
static_assert(static_cast<int>(ReduceKind::Sum) == c10d::ReduceOp::SUM &&
                  static_cast<int>(ReduceKind::Avg) == c10d::ReduceOp::AVG &&
                  static_cast<int>(ReduceKind::Product) == c10d::ReduceOp::PRODUCT &&
                  static_cast<int>(ReduceKind::Min) == c10d::ReduceOp::MIN &&
                  static_cast<int>(ReduceKind::Max) == c10d::ReduceOp::MAX &&
                  static_cast<int>(ReduceKind::BitAnd) == c10d::ReduceOp::BAND &&
                  static_cast<int>(ReduceKind::BitOr) == c10d::ReduceOp::BOR &&
                  static_cast<int>(ReduceKind::BitXor) == c10d::ReduceOp::BXOR &&
                  static_cast<int>(ReduceKind::PremulSum) == c10d::ReduceOp::PREMUL_SUM,
              "ReduceKind must follow c10d::ReduceOp's numbering");

shm::Call call_of(const at::Tensor& tensor, ReduceKind kind, double factor) {
  shm::Call call;
  call.op = static_cast<uint32_t>(kind);
  call.dtype = static_cast<int64_t>(tensor.scalar_type());
  call.count = static_cast<uint64_t>(tensor.numel());
  call.element_bytes = tensor.element_size();
  call.factor = factor;
  return call;
}

std::string describe(const shm::Call& call) {
  static const char* const kinds[] = {"?", "all_reduce", "all_reduce", "all_reduce (gather phase)", "broadcast",
                                      "all_gather", "reduce_scatter", "barrier"};
  const auto kind = static_cast<shm::CallKind>(call.kind);
  std::ostringstream out;
  out << (call.kind < static_cast<uint32_t>(shm::CallKind::End) ? kinds[call.kind] : "?") << "(";
  out << dtype_name(call.dtype) << "[" << call.count << "]";
  const bool reduces = kind == shm::CallKind::AllReduce || kind == shm::CallKind::ReduceSlices ||
                       kind == shm::CallKind::ReduceScatter;
  if (reduces && call.op < static_cast<uint32_t>(ReduceKind::Count)) {
    out << ", " << reduce_kind_name(static_cast<ReduceKind>(call.op));
    if (static_cast<ReduceKind>(call.op) == ReduceKind::PremulSum) out << " by " << call.factor;
  }
  if (kind == shm::CallKind::Broadcast) out << ", root " << call.root;
  out << ")";
  return out.str();
}

shm::Reduce reducer(at::ScalarType dtype, ReduceKind kind, double factor, int world) {
  return [=](const std::byte* const* parts, std::byte* out, uint64_t count) {
    reduce_in_order(reinterpret_cast<const void* const*>(parts), world, out, static_cast<int64_t>(count), dtype, kind,
                    factor);
  };
}


bool movable(const at::Tensor& tensor) {
  return tensor.device().is_cpu() && tensor.layout() == at::kStrided && !tensor.is_quantized() &&
         !tensor.is_nested() && tensor.element_size() <= 16;
}

std::optional<ReduceKind> reduction(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) {
  if (tensors.size() != 1 || !movable(tensors[0]) || op.op_ >= c10d::ReduceOp::UNUSED) return std::nullopt;
  const auto kind = static_cast<ReduceKind>(static_cast<int>(op.op_));
  if (!reduce_in_order_supported(tensors[0].scalar_type(), kind)) return std::nullopt;
  return kind;
}

double premul_factor(const c10d::ReduceOp& op) {
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return 1.0;
  // NCCLPreMulSumSupplement: torch 2.11's name; later versions keep it as an alias of PreMulSumSupplement.
  const auto* supplement = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  TORCH_CHECK(supplement != nullptr, "accel process group: PREMUL_SUM without its factor");
  if (supplement->tensor_factor.defined()) return supplement->tensor_factor.to(at::kCPU).item<double>();
  return supplement->double_factor;
}

void check_same_dtype(const at::Tensor& output, const at::Tensor& input, const char* what) {
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "accel process group: ", what, " output is ",
              output.scalar_type(), " but the input is ", input.scalar_type());
  TORCH_CHECK(output.device().is_cpu(), "accel process group: ", what, " output is on ", output.device());
}

at::Tensor dense(const at::Tensor& tensor) {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  return dense_values(tensor);
}

void write_results(const std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& results, const char* what) {
  for (const at::Tensor& output : outputs) {
    TORCH_CHECK(at::has_internal_overlap(output) != at::MemOverlap::Yes, "accel process group: ", what,
                " cannot write its result into a tensor whose elements share memory (an expanded tensor, stride 0 ",
                "in a dimension of size > 1; strides ", output.strides(), "); pass one that owns its elements, ",
                "e.g. tensor.clone()");
  }
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!results[i].is_same(outputs[i])) outputs[i].copy_(results[i]);
  }
}

void check_gather_outputs(const std::vector<at::Tensor>& outputs, const at::Tensor& input, int world) {
  TORCH_CHECK(outputs.size() == static_cast<size_t>(world), "accel process group: all_gather needs ",
              world, " output tensors, got ", outputs.size());
  for (const at::Tensor& out : outputs) {
    check_same_dtype(out, input, "all_gather");
    TORCH_CHECK(out.numel() == input.numel(), "accel process group: all_gather outputs must have the input's ",
                input.numel(), " elements, got ", out.numel());
  }
}

}  // namespace accel::backend
