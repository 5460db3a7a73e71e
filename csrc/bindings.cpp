// pybind11 surface of zerokern._C. The only file that sees at::Tensor: it turns tensors into
// raw pointers and picks the CPU or CUDA launcher. Argument validation with clear,
// argument-naming errors happens in Python (zerokern/ops) before anything is written; the
// checks here are a last line of defence for direct callers. copy_flat is the exception: a
// per-tensor check costs ~1 us in Python, so for the many small tensors of a bucket it runs
// the flatten checks itself, with the Python wording.
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <string>
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

// A device as Python prints a torch.device ("cpu", "cuda:0").
std::string dev_str(const at::Device& d) { return d.str(); }

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

// Fused AdamW over a flat range with compressed state (zerokern/ops/adamw_compressed.py, the
// range contract): dtypes pick the formats, optional tensors are None where the format has no
// use for them. Python validates first with argument-naming errors; these checks guard direct
// callers.
void adamw_compressed(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg,
                      at::Tensor exp_avg_sq, std::optional<at::Tensor> exp_avg_absmax,
                      std::optional<at::Tensor> exp_avg_sq_absmax,
                      std::optional<at::Tensor> param_lp, std::optional<at::Tensor> sr_index,
                      uint64_t seed, int64_t step, const at::Tensor& tables,
                      int64_t format_version, double decay,
                      double one_minus_beta1, double beta2, double one_minus_beta2,
                      double step_size, double bc2_sqrt, double eps, double inv_grad_scale) {
  const int64_t n = param.numel();
  const auto dev = param.device();
  const int64_t nb = (n + zk::kQuantBlock - 1) / zk::kQuantBlock;
  check_flat(param, "param", n, dev);
  check_flat(grad, "grad", n, dev);
  check_flat(exp_avg, "exp_avg", n, dev);
  check_flat(exp_avg_sq, "exp_avg_sq", n, dev);
  check_flat(tables, "tables", 1024, dev);
  TORCH_CHECK_TYPE(tables.scalar_type() == at::kFloat, "tables must be float32");
  zk::CompressedArgs a{};
  a.n = n;
  a.pdt = to_dtype(param, "param");
  TORCH_CHECK_TYPE(a.pdt != zk::DType::F16, "param must be float32 or bfloat16");
  a.gdt = to_dtype(grad, "grad");
  TORCH_CHECK_TYPE(exp_avg_sq.scalar_type() == exp_avg.scalar_type(),
                   "exp_avg_sq must have exp_avg's dtype (", exp_avg.scalar_type(), ")");
  switch (exp_avg.scalar_type()) {
    case at::kFloat: a.mfmt = zk::MomentFmt::F32; break;
    case at::kBFloat16: a.mfmt = zk::MomentFmt::BF16; break;
    case at::kByte: a.mfmt = zk::MomentFmt::U8; break;
    default: TORCH_CHECK_TYPE(false, "exp_avg must be float32, bfloat16 or uint8");
  }
  const bool u8 = a.mfmt == zk::MomentFmt::U8;
  TORCH_CHECK(format_version == 2 || format_version == 3,
              "format_version must be 2 or 3, got ", format_version);
  if (u8 && format_version == 3) a.mfmt = zk::MomentFmt::U8V3;
  for (auto* opt : {&exp_avg_absmax, &exp_avg_sq_absmax}) {
    const char* name = opt == &exp_avg_absmax ? "exp_avg_absmax" : "exp_avg_sq_absmax";
    TORCH_CHECK(opt->has_value() == u8, name,
                u8 ? " is required with uint8 moments" : " must be None unless moments are uint8");
    if (u8) {
      check_flat(**opt, name, nb, dev);
      TORCH_CHECK_TYPE((*opt)->scalar_type() == at::kFloat, name, " must be float32");
    }
  }
  if (u8) {
    a.exp_avg_absmax = exp_avg_absmax->data_ptr<float>();
    a.exp_avg_sq_absmax = exp_avg_sq_absmax->data_ptr<float>();
  }
  a.lpdt = zk::DType::BF16;
  if (param_lp.has_value()) {
    TORCH_CHECK(a.pdt == zk::DType::F32, "param_lp must be None with a bfloat16 param");
    check_flat(*param_lp, "param_lp", n, dev);
    a.lpdt = to_dtype(*param_lp, "param_lp");
    TORCH_CHECK_TYPE(a.lpdt != zk::DType::F32, "param_lp must be bfloat16 or float16");
    a.param_lp = param_lp->data_ptr();
  }
  const bool sr = a.pdt == zk::DType::BF16;
  TORCH_CHECK(sr_index.has_value() == sr, "sr_index ",
              sr ? "is required with a bfloat16 param" : "must be None with a float32 param");
  if (sr) {
    check_flat(*sr_index, "sr_index", nb, dev);
    TORCH_CHECK_TYPE(sr_index->scalar_type() == at::kLong, "sr_index must be int64");
    a.sr_index = sr_index->data_ptr<int64_t>();
  }
  TORCH_CHECK(step >= 0 && step < (int64_t(1) << 32), "step must be in [0, 2**32), got ", step);
  a.seed = seed;
  a.step = uint32_t(step);
  a.tables = tables.data_ptr<float>();
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.exp_avg = exp_avg.data_ptr();
  a.exp_avg_sq = exp_avg_sq.data_ptr();
  const zk::AdamScalars s{float(decay),     float(one_minus_beta1), float(beta2),
                          float(one_minus_beta2), float(step_size), float(bc2_sqrt),
                          float(eps),       float(inv_grad_scale)};
  if (n == 0) return;
  if (dev.is_cpu()) {
    zk::adamw_compressed_cpu(a, s);
    return;
  }
#ifdef ZK_WITH_CUDA
  TORCH_CHECK(dev.is_cuda(), "adamw_compressed: unsupported device ", dev);
  c10::cuda::CUDAGuard guard(dev);
  zk::adamw_compressed_cuda(a, s, c10::cuda::getCurrentCUDAStream().stream());
#else
  TORCH_CHECK(false, "adamw_compressed: zerokern._C was built without CUDA kernels");
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

// Runs the byte copies `segs` (all on `dev`) in one pass: OpenMP on the CPU, one kernel launch
// on CUDA. `what` names the caller in errors.
void run_segments(const std::vector<zk::CopySegment>& segs, const at::Device& dev,
                  const char* what) {
  if (dev.is_cpu()) {
    zk::copy_segments_cpu(segs.data(), int64_t(segs.size()));
    return;
  }
#ifdef ZK_WITH_CUDA
  TORCH_CHECK(dev.is_cuda(), what, ": unsupported device ", dev);
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
  TORCH_CHECK(false, what, ": zerokern._C was built without CUDA kernels");
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
  run_segments(segs, dev, "copy_segments");
}

std::string str_of(const py::handle& h) { return py::str(h).cast<std::string>(); }

// flatten_into_ / unflatten_from_ without a Python view per tensor: piece i is elements
// [starts[i], starts[i] + lengths[i]) of tensors[i] (default: all of it), slot i is
// [offsets[i], offsets[i] + lengths[i]) of `flat` (default: packed from 0); to_flat copies the
// pieces into the slots, else the slots into the pieces. Every check of
// zerokern/ops/flatten.py's _plan runs here first, in the same order and with the same
// TypeError / ValueError text (tests compare both), so nothing is written when one fails.
// `flat` itself (a 1-D contiguous tensor) was checked by the caller. Bumps the version of
// what it writes, as the custom op's ADInplaceOrView kernel does. Returns false, having
// checked and written nothing more, when a tensor is not a plain one with its own storage (a
// __torch_dispatch__ subclass such as FakeTensor or DTensor, a functorch wrapper): those
// must see the custom op, so the caller takes that path.
bool copy_flat(const py::list& tensors, const at::Tensor& flat, const std::string& flat_name,
               std::optional<std::vector<int64_t>> offsets,
               std::optional<std::vector<int64_t>> starts,
               std::optional<std::vector<int64_t>> lengths, bool to_flat) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), flat_name, " must be 1-D and contiguous");
  TORCH_CHECK(starts.has_value() == lengths.has_value(), "copy_flat: starts without lengths");
  const int64_t nt = int64_t(py::len(tensors));
  std::vector<const at::Tensor*> ts(size_t(nt), nullptr);
  for (int64_t i = 0; i < nt; ++i) {
    PyObject* o = PyList_GET_ITEM(tensors.ptr(), i);
    if (!THPVariable_Check(o))
      throw py::type_error("tensors[" + std::to_string(i) + "] must be a torch.Tensor, got " +
                           str_of(py::handle(reinterpret_cast<PyObject*>(Py_TYPE(o))).attr("__name__")));
    ts[size_t(i)] = &THPVariable_Unpack(o);
  }
  const auto plain = [](const at::Tensor& t) {
    return t.has_storage() && !t.unsafeGetTensorImpl()->is_python_dispatch();
  };
  if (!plain(flat)) return false;
  for (const at::Tensor* t : ts)
    if (!plain(*t)) return false;
  const auto dt = flat.scalar_type();
  const auto dev = flat.device();
  for (int64_t i = 0; i < nt; ++i) {
    const at::Tensor& t = *ts[size_t(i)];
    if (t.scalar_type() != dt)
      throw py::type_error("tensors[" + std::to_string(i) + "] has dtype " +
                           str_of(py::cast(t.scalar_type())) + ", " + flat_name + " has " +
                           str_of(py::cast(dt)));
    if (t.device() != dev)
      throw py::value_error("tensors[" + std::to_string(i) + "] is on " + dev_str(t.device()) +
                            ", " + flat_name + " is on " + dev_str(dev));
    if (!t.is_contiguous())
      throw py::value_error("tensors[" + std::to_string(i) + "] must be contiguous");
  }
  std::vector<int64_t> st, len;
  if (starts.has_value()) {
    st = std::move(*starts);
    len = std::move(*lengths);
    TORCH_CHECK(st.size() == len.size(), "copy_flat: starts and lengths differ in length");
    if (int64_t(st.size()) != nt)
      throw py::value_error("ranges has " + std::to_string(st.size()) + " entries for " +
                            std::to_string(nt) + " tensors");
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t s = st[size_t(i)], n = len[size_t(i)], numel = ts[size_t(i)]->numel();
      if (s < 0 || n < 0 || s > numel - n)
        throw py::value_error("ranges[" + std::to_string(i) + "] = (" + std::to_string(s) + ", " +
                              std::to_string(n) + ") is outside tensors[" + std::to_string(i) +
                              "] (" + std::to_string(numel) + " elements)");
    }
  } else {
    st.assign(size_t(nt), 0);
    len.resize(size_t(nt));
    for (int64_t i = 0; i < nt; ++i) len[size_t(i)] = ts[size_t(i)]->numel();
  }
  std::vector<int64_t> off;
  const bool packed = !offsets.has_value();
  if (packed) {
    off.resize(size_t(nt));
    int64_t pos = 0;
    for (int64_t i = 0; i < nt; ++i) {
      off[size_t(i)] = pos;
      pos += len[size_t(i)];
    }
  } else {
    off = std::move(*offsets);
    if (int64_t(off.size()) != nt)
      throw py::value_error("offsets has " + std::to_string(off.size()) + " entries for " +
                            std::to_string(nt) + " tensors");
  }
  const int64_t flat_numel = flat.numel();
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t o = off[size_t(i)], n = len[size_t(i)];
    if (o < 0 || o > flat_numel - n)
      throw py::value_error("offsets[" + std::to_string(i) + "] = " + std::to_string(o) +
                            " with " + std::to_string(n) + " elements does not fit in " +
                            flat_name + " (" + std::to_string(flat_numel) + " elements)");
  }
  // Slots written in parallel must not overlap. Packed slots never do; otherwise the first
  // overlapping neighbours in (offset, end, index) order are named, as _plan names them.
  if (!packed) {
    std::vector<std::array<int64_t, 3>> spans;
    spans.reserve(size_t(nt));
    for (int64_t i = 0; i < nt; ++i)
      if (len[size_t(i)]) spans.push_back({off[size_t(i)], off[size_t(i)] + len[size_t(i)], i});
    if (!std::is_sorted(spans.begin(), spans.end())) std::sort(spans.begin(), spans.end());
    for (size_t k = 1; k < spans.size(); ++k)
      if (spans[k][0] < spans[k - 1][1])
        throw py::value_error("offsets overlap in " + flat_name + ": tensors[" +
                              std::to_string(spans[k - 1][2]) + "] and tensors[" +
                              std::to_string(spans[k][2]) + "]");
  }
  if (nt == 0) return true;
  const int64_t item = int64_t(flat.element_size());
  char* fbase = static_cast<char*>(flat.data_ptr());
  std::vector<zk::CopySegment> segs;
  segs.reserve(size_t(nt));
  for (int64_t i = 0; i < nt; ++i) {
    const int64_t n = len[size_t(i)];
    if (n == 0) continue;
    char* piece = static_cast<char*>(ts[size_t(i)]->data_ptr()) + st[size_t(i)] * item;
    char* slot = fbase + off[size_t(i)] * item;
    segs.push_back(to_flat ? zk::CopySegment{piece, slot, n * item}
                           : zk::CopySegment{slot, piece, n * item});
  }
  run_segments(segs, dev, "copy_flat");
  if (to_flat) {
    if (!flat.is_inference()) torch::autograd::impl::bump_version(flat);
  } else {
    for (const at::Tensor* t : ts)
      if (!t->is_inference()) torch::autograd::impl::bump_version(*t);
  }
  return true;
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
  m.def("adamw_compressed", &adamw_compressed,
        "fused AdamW over one flat range with compressed state (in place)", py::arg("param"),
        py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("exp_avg_absmax"),
        py::arg("exp_avg_sq_absmax"), py::arg("param_lp"), py::arg("sr_index"), py::arg("seed"),
        py::arg("step"), py::arg("tables"), py::arg("format_version"), py::arg("decay"),
        py::arg("one_minus_beta1"),
        py::arg("beta2"), py::arg("one_minus_beta2"), py::arg("step_size"), py::arg("bc2_sqrt"),
        py::arg("eps"), py::arg("inv_grad_scale"));
  m.def("sq_norm", &sq_norm, "sum of squares as a 0-dim float32 tensor", py::arg("t"));
  m.def("copy_segments", &copy_segments, "dsts[i].copy_(srcs[i]) for all i in one pass",
        py::arg("srcs"), py::arg("dsts"));
  m.def("copy_flat", &copy_flat,
        "flatten_into_ (to_flat) / unflatten_from_ on base tensors: checks, then one pass",
        py::arg("tensors"), py::arg("flat"), py::arg("flat_name"), py::arg("offsets"),
        py::arg("starts"), py::arg("lengths"), py::arg("to_flat"));
  zk::bind_arena(m);
}
