// pybind11 surface of zerokern._C. The only file that sees at::Tensor: it turns tensors into
// raw pointers and picks the CPU or CUDA launcher. Argument validation with clear,
// argument-naming errors happens in Python (zerokern/ops) before anything is written; the
// checks here are a last line of defence for direct callers.
#include <torch/extension.h>

#include <vector>

#include "arena.h"
#include "kernels.h"

#ifdef ZK_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace {

zk::DType to_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return zk::DType::F32;
    case at::kBFloat16: return zk::DType::BF16;
    case at::kHalf: return zk::DType::F16;
    default: TORCH_CHECK_TYPE(false, name, ": unsupported dtype ", t.scalar_type());
  }
}

void check_flat(const at::Tensor& t, const char* name, int64_t n, const at::Device& dev) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), name, " must be 1-D and contiguous");
  TORCH_CHECK(t.numel() == n, name, " has ", t.numel(), " elements, expected ", n);
  TORCH_CHECK(t.device() == dev, name, " is on ", t.device(), ", expected ", dev);
}

void adamw(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
           std::optional<at::Tensor> param_lp, double decay, double one_minus_beta1,
           double beta2, double one_minus_beta2, double step_size, double bc2_sqrt, double eps,
           double inv_grad_scale) {
  const int64_t n = param.numel();
  const auto dev = param.device();
  TORCH_CHECK_TYPE(param.scalar_type() == at::kFloat, "param must be float32");
  TORCH_CHECK_TYPE(exp_avg.scalar_type() == at::kFloat, "exp_avg must be float32");
  TORCH_CHECK_TYPE(exp_avg_sq.scalar_type() == at::kFloat, "exp_avg_sq must be float32");
  check_flat(param, "param", n, dev);
  check_flat(grad, "grad", n, dev);
  check_flat(exp_avg, "exp_avg", n, dev);
  check_flat(exp_avg_sq, "exp_avg_sq", n, dev);
  void* lp = nullptr;
  zk::DType lpdt = zk::DType::BF16;
  if (param_lp.has_value()) {
    check_flat(*param_lp, "param_lp", n, dev);
    lpdt = to_dtype(*param_lp, "param_lp");
    TORCH_CHECK_TYPE(lpdt != zk::DType::F32, "param_lp must be bfloat16 or float16");
    lp = param_lp->data_ptr();
  }
  const zk::AdamScalars s{float(decay),     float(one_minus_beta1), float(beta2),
                          float(one_minus_beta2), float(step_size), float(bc2_sqrt),
                          float(eps),       float(inv_grad_scale)};
  const zk::DType gdt = to_dtype(grad, "grad");
  if (n == 0) return;
  if (dev.is_cpu()) {
    zk::adamw_cpu(param.data_ptr<float>(), grad.data_ptr(), gdt, exp_avg.data_ptr<float>(),
                  exp_avg_sq.data_ptr<float>(), lp, lpdt, n, s);
    return;
  }
#ifdef ZK_WITH_CUDA
  TORCH_CHECK(dev.is_cuda(), "adamw: unsupported device ", dev);
  c10::cuda::CUDAGuard guard(dev);
  zk::adamw_cuda(param.data_ptr<float>(), grad.data_ptr(), gdt, exp_avg.data_ptr<float>(),
                 exp_avg_sq.data_ptr<float>(), lp, lpdt, n, s,
                 c10::cuda::getCurrentCUDAStream().stream());
#else
  TORCH_CHECK(false, "adamw: zerokern._C was built without CUDA kernels");
#endif
}

at::Tensor sq_norm(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 1 && x.is_contiguous(), "t must be 1-D and contiguous");
  const zk::DType dt = to_dtype(x, "t");
  if (x.device().is_cpu()) {
    double r = zk::sq_norm_cpu(x.data_ptr(), dt, x.numel());
    return at::scalar_tensor(r, at::TensorOptions().dtype(at::kFloat));
  }
#ifdef ZK_WITH_CUDA
  TORCH_CHECK(x.is_cuda(), "sq_norm: unsupported device ", x.device());
  c10::cuda::CUDAGuard guard(x.device());
  auto opts = x.options().dtype(at::kFloat);
  at::Tensor out = at::empty({}, opts);
  at::Tensor ws = at::empty({zk::sq_norm_cuda_workspace_floats()}, opts);
  zk::sq_norm_cuda(x.data_ptr(), dt, x.numel(), out.data_ptr<float>(), ws.data_ptr<float>(),
                   c10::cuda::getCurrentCUDAStream().stream());
  return out;
#else
  TORCH_CHECK(false, "sq_norm: zerokern._C was built without CUDA kernels");
#endif
}

// dsts[i] receives srcs[i]; each pair has the same number of bytes and both are contiguous.
void copy_segments(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts) {
  TORCH_CHECK(srcs.size() == dsts.size(), "copy_segments: srcs and dsts differ in length");
  if (srcs.empty()) return;
  const auto dev = dsts[0].device();
  std::vector<zk::CopySegment> segs;
  segs.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const auto& s = srcs[i];
    const auto& d = dsts[i];
    TORCH_CHECK(s.is_contiguous() && d.is_contiguous(), "copy_segments: segment ", i,
                " is not contiguous");
    TORCH_CHECK(s.nbytes() == d.nbytes(), "copy_segments: segment ", i, " sizes differ");
    TORCH_CHECK(s.device() == dev && d.device() == dev, "copy_segments: segment ", i,
                " is on another device");
    if (s.nbytes() == 0) continue;
    segs.push_back({static_cast<const char*>(s.data_ptr()), static_cast<char*>(d.data_ptr()),
                    int64_t(s.nbytes())});
  }
  if (dev.is_cpu()) {
    zk::copy_segments_cpu(segs.data(), int64_t(segs.size()));
    return;
  }
#ifdef ZK_WITH_CUDA
  TORCH_CHECK(dev.is_cuda(), "copy_segments: unsupported device ", dev);
  c10::cuda::CUDAGuard guard(dev);
  // Chunk table: built on the host, shipped with one pinned async copy, read by one launch.
  std::vector<zk::CopySegment> chunks;
  for (const auto& sg : segs)
    for (int64_t off = 0; off < sg.bytes; off += zk::kCopyChunkBytes)
      chunks.push_back({sg.src + off, sg.dst + off, std::min(zk::kCopyChunkBytes, sg.bytes - off)});
  if (chunks.empty()) return;
  const int64_t table_bytes = int64_t(chunks.size() * sizeof(zk::CopySegment));
  at::Tensor host = at::empty({table_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), chunks.data(), size_t(table_bytes));
  at::Tensor table = host.to(dev, /*non_blocking=*/true);
  zk::copy_chunks_cuda(static_cast<const zk::CopySegment*>(table.data_ptr()),
                       int64_t(chunks.size()), c10::cuda::getCurrentCUDAStream().stream());
#else
  TORCH_CHECK(false, "copy_segments: zerokern._C was built without CUDA kernels");
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "zerokern native kernels (fused AdamW, sq_norm, bucket copies) and arena bookkeeping";
#ifdef ZK_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def("adamw", &adamw, "fused AdamW over one flat shard (in place)", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("param_lp"),
        py::arg("decay"), py::arg("one_minus_beta1"), py::arg("beta2"),
        py::arg("one_minus_beta2"), py::arg("step_size"), py::arg("bc2_sqrt"), py::arg("eps"),
        py::arg("inv_grad_scale"));
  m.def("sq_norm", &sq_norm, "sum of squares as a 0-dim float32 tensor", py::arg("t"));
  m.def("copy_segments", &copy_segments, "dsts[i].copy_(srcs[i]) for all i in one pass",
        py::arg("srcs"), py::arg("dsts"));
  zk::bind_arena(m);
}
