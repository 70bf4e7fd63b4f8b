// Page copies between KV pools: copy_blocks(dst[], src[], dst_pages, src_pages).
//
// For every tensor pair (dst[j], src[j]) and every i: the bytes of page dst_pages[i] of
// dst[j] become those of page src_pages[i] of src[j]. A page is a slice along dim 0 of a
// contiguous tensor (KV pages [pages, block, heads, dim], per-token scales [pages, block,
// heads]); any dtype, copied as bytes, so quantized pages travel with their scales byte for
// byte. One memcpy per (tensor, page), split over threads when ``parallel`` (a copy on the
// thread that runs the model, between steps) or when large: one pass over the bytes, where
// torch's index_select + index_copy_ makes two (vLLM's swap_blocks / copy_blocks do the same
// job on GPUs).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace pagedkv {
namespace {

constexpr int64_t kParallelBytes = 8 << 20;  // copies below this run on the calling thread

void copy_blocks(at::TensorList dst, at::TensorList src, const at::Tensor& dst_pages, const at::Tensor& src_pages,
                 bool parallel) {
  TORCH_CHECK(dst.size() == src.size(), "copy_blocks: ", dst.size(), " destination tensors but ", src.size(), " sources");
  TORCH_CHECK(dst_pages.dim() == 1 && src_pages.dim() == 1 && dst_pages.scalar_type() == at::kLong &&
              src_pages.scalar_type() == at::kLong && dst_pages.numel() == src_pages.numel() &&
              dst_pages.device().is_cpu() && src_pages.device().is_cpu(),
              "copy_blocks: page lists must be 1-D int64 CPU tensors of one length");
  const int64_t n = dst_pages.numel();
  const at::Tensor dp = dst_pages.contiguous(), sp = src_pages.contiguous();
  const int64_t *di = dp.data_ptr<int64_t>(), *si = sp.data_ptr<int64_t>();
  std::vector<char*> dptr;
  std::vector<const char*> sptr;
  std::vector<int64_t> page_bytes;
  for (size_t j = 0; j < dst.size(); ++j) {
    const at::Tensor &d = dst[j], &s = src[j];
    TORCH_CHECK(d.device().is_cpu() && s.device().is_cpu() && d.is_contiguous() && s.is_contiguous() && d.dim() >= 1 &&
                s.dim() >= 1, "copy_blocks: tensor ", j, " must be contiguous CPU tensors with a page dimension");
    TORCH_CHECK(d.element_size() == s.element_size() && d.numel() / std::max<int64_t>(d.size(0), 1) ==
                s.numel() / std::max<int64_t>(s.size(0), 1), "copy_blocks: tensor ", j, " has pages of another size");
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(di[i] >= 0 && di[i] < d.size(0) && si[i] >= 0 && si[i] < s.size(0), "copy_blocks: page ",
                  i, " out of range for tensor ", j);
    dptr.push_back(static_cast<char*>(d.data_ptr()));
    sptr.push_back(static_cast<const char*>(s.data_ptr()));
    page_bytes.push_back(d.numel() / std::max<int64_t>(d.size(0), 1) * d.element_size());
  }
  const int64_t total = static_cast<int64_t>(dst.size()) * n;
  int64_t bytes = 0;
  for (int64_t pb : page_bytes) bytes += pb * n;
  const auto copy = [&](int64_t a, int64_t b) {
    for (int64_t k = a; k < b; ++k) {
      const int64_t j = k / n, i = k % n, pb = page_bytes[j];
      std::memcpy(dptr[j] + di[i] * pb, sptr[j] + si[i] * pb, pb);
    }
  };
  // Otherwise threads only for large copies: a layer's few pages saved beside a running
  // forward must not start a second OpenMP team on the same cores.
  if (parallel || bytes >= kParallelBytes) at::parallel_for(0, total, 8, copy);
  else copy(0, total);
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("copy_blocks(Tensor(a!)[] dst, Tensor[] src, Tensor dst_pages, Tensor src_pages, bool parallel=False) -> ()",
        &pagedkv::copy_blocks);
}
