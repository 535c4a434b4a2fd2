// Host side of the CUDA flash-CCE head: loads the kernels' fatbin once per
// process with the driver API (libmlx links the CUDA runtime statically, so
// kernels registered with our own runtime would be invisible to MLX's graphs),
// plans the launches and records them on MLX's command encoder.
#include "cuda_head.h"

#include <cuda.h>
#include <dlfcn.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "mlx/backend/cuda/device.h"
#include "mlx/backend/cuda/utils.h"
#include "params.h"
#include "plan.h"

namespace flash_cce::cuda {

namespace {

void check(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    const char* msg = nullptr;
    cuGetErrorString(r, &msg);
    throw std::runtime_error(std::string("[flash_cce] ") + what + ": " +
                             (msg ? msg : "unknown CUDA error"));
  }
}

// The fatbin installed beside the extension module (FLASH_CCE_FATBIN overrides).
std::string fatbin_path() {
  if (const char* env = std::getenv("FLASH_CCE_FATBIN")) {
    return env;
  }
  Dl_info info{};
  if (!dladdr(reinterpret_cast<void*>(&fatbin_path), &info) || !info.dli_fname) {
    throw std::runtime_error("[flash_cce] cannot locate the extension module");
  }
  std::string so = info.dli_fname;
  return so.substr(0, so.find_last_of('/') + 1) + "flash_cce_kernels.fatbin";
}

// The image of the fatbin that the driver picked for this GPU.
struct Image {
  int arch = 0;           // __CUDA_ARCH__ it was compiled for (e.g. 900, 800)
  int binary = 0;         // compute capability of the loaded machine code (e.g. 90)
  int device = 0;         // the GPU's compute capability
  bool jit = false;       // PTX compiled by the driver at load time
  bool wgmma = false;     // holds the Hopper kernels
};

class Kernels {
 public:
  CUfunction get(const std::string& name, int ordinal, int smem) {
    std::lock_guard<std::mutex> lock(mutex_);
    ensure_loaded(ordinal);
    auto it = fns_.find(name);
    if (it != fns_.end()) {
      return it->second;
    }
    CUfunction fn;
    check(cuModuleGetFunction(&fn, module_, name.c_str()), ("kernel " + name).c_str());
    check(cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
          "shared memory size");
    fns_.emplace(name, fn);
    return fn;
  }

  const Image& image(int ordinal) {
    std::lock_guard<std::mutex> lock(mutex_);
    ensure_loaded(ordinal);
    return image_info_;
  }

 private:
  void ensure_loaded(int ordinal) {
    if (!module_) {
      ordinal_ = ordinal;
      load();
      describe();
    }
  }

  int read_global(const char* name) {
    CUdeviceptr ptr;
    size_t bytes = 0;
    check(cuModuleGetGlobal(&ptr, &bytes, module_, name), name);
    int v = 0;
    check(cuMemcpyDtoH(&v, ptr, sizeof(v)), name);
    return v;
  }

  // A SASS image runs as compiled (binary == arch / 10); PTX is compiled by
  // the driver for the GPU at hand, so its binary version is the GPU's.
  void describe() {
    Image& im = image_info_;
    im.arch = read_global("fcce_image_arch");
    im.wgmma = read_global("fcce_image_wgmma") != 0;
    CUfunction fn;
    check(cuModuleGetFunction(&fn, module_, "fcce_zero"), "kernel fcce_zero");
    check(cuFuncGetAttribute(&im.binary, CU_FUNC_ATTRIBUTE_BINARY_VERSION, fn),
          "binary version");
    CUdevice dev;
    int major = 0, minor = 0;
    check(cuDeviceGet(&dev, ordinal_), "cuDeviceGet");
    check(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
          "compute capability");
    check(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
          "compute capability");
    im.device = major * 10 + minor;
    im.jit = im.binary * 10 != im.arch;
  }

  void load() {
    const std::string path = fatbin_path();
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      throw std::runtime_error("[flash_cce] missing CUDA kernels: " + path);
    }
    image_.assign(std::istreambuf_iterator<char>(in), {});
    // MLX has made its device current through the runtime; make sure the
    // driver sees that primary context on this thread too.
    CUcontext ctx = nullptr;
    check(cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
    if (!ctx) {
      CUdevice dev;
      check(cuInit(0), "cuInit");
      check(cuDeviceGet(&dev, ordinal_), "cuDeviceGet");
      check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
      check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    }
    check(cuModuleLoadData(&module_, image_.data()), ("loading " + path).c_str());
  }

  std::mutex mutex_;
  std::string image_;
  CUmodule module_ = nullptr;
  Image image_info_;
  int ordinal_ = 0;
  std::unordered_map<std::string, CUfunction> fns_;
};

Kernels& kernels() {
  static Kernels k;
  return k;
}

int32_t src_kind(mx::Dtype t) {
  return t == mx::bfloat16 ? kBF16 : t == mx::float16 ? kF16 : kF32;
}

// Tensor-core operand type: fp16 when h is fp16, else bf16 (fp32 operands are
// rounded to bf16 in the loaders; accumulation is always fp32).
bool use_f16(const HeadProblem& p) {
  return p.h_dtype == mx::float16;
}

mx::Dtype compute_dtype(const HeadProblem& p) {
  return use_f16(p) ? mx::float16 : mx::bfloat16;
}

// A row-major [rows, cols] operand of dtype t, read natively when it already
// is the compute type and rows are 16-byte aligned.
Operand dense(const void* ptr, mx::Dtype t, int64_t rows, int64_t cols, int64_t ld,
              mx::Dtype compute) {
  Operand o{};
  o.ptr = ptr;
  o.ld = ld;
  o.rows = rows;
  o.cols = cols;
  const int64_t esize = t == mx::float32 ? 4 : 2;
  const bool aligned = (ld * esize) % 16 == 0 && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  o.kind = (t == compute && aligned) ? kNative : src_kind(t);
  o.vec_ok = aligned;
  return o;
}

Operand weight(const HeadProblem& p, mx::Dtype compute) {
  if (!p.cfg.quantized) {
    return dense(p.w, p.w_dtype, p.V, p.H, p.H, compute);
  }
  Operand o{};
  o.ptr = p.w;
  o.ld = p.H;
  o.rows = p.V;
  o.cols = p.H;
  o.kind = kQuant;
  o.scales = p.scales;
  o.biases = p.biases;
  o.sb_kind = src_kind(p.sb_dtype);
  o.group_size = p.cfg.group_size;
  o.bits = p.cfg.bits;
  return o;
}

// Kernel name suffix: compute type and weight loader.
std::string variant(const HeadProblem& p) {
  std::string t = use_f16(p) ? "f16" : "bf16";
  if (!p.cfg.quantized) {
    return t + "_dense";
  }
  if (p.cfg.bits == 4 || p.cfg.bits == 8) {
    return t + "_q" + std::to_string(p.cfg.bits);
  }
  return t + "_qany";
}

mx::array scratch(mx::cu::CommandEncoder& enc, mx::Shape shape, mx::Dtype t) {
  mx::array a(std::move(shape), t, nullptr, {});
  a.set_data(mx::allocator::malloc(a.nbytes()));
  enc.add_temporary(a);
  return a;
}

void alloc(std::vector<mx::array>& outputs) {
  for (auto& o : outputs) {
    o.set_data(mx::allocator::malloc(o.nbytes()));
  }
}

// Records one kernel on the encoder (1-D grids: no y/z limits to respect).
struct Launch {
  mx::cu::CommandEncoder& enc;
  int ordinal;
  template <class P>
  void operator()(const std::string& name, int64_t blocks, uint32_t smem, P& params,
                  int threads = kThreads) {
    CUfunction fn = kernels().get(name, ordinal, std::max<int>(smem, 1));
    enc.add_kernel_node_ex(fn, dim3(static_cast<unsigned>(blocks)), dim3(threads), dim3(1),
                           smem, params);
  }
};

// The Hopper path takes a 16-bit h with 16-byte rows and either a dense W of
// the same type or a 4- or 8-bit one (dequantized by the producer warpgroup).
// Other heads, and tuning.wgmma = false, use the mma.sync kernels.
bool use_wgmma(const mx::Stream& s, const HeadProblem& p) {
  const auto& dev = mx::cu::device(s.device);
  // The Hopper kernels read packed rows as 16-byte vectors and find a column's
  // group with a shift. They dequantize 4-bit codes two at a time with one fma
  // in the operand type, exact only for scales and biases of that type; others
  // (fp16 ones with bf16 h, fp32 ones) take the portable kernels' fp32 fma.
  const int gs = p.cfg.group_size;
  const bool q4_exact = p.cfg.bits != 4 || p.sb_dtype == compute_dtype(p);
  const bool weight_ok = reinterpret_cast<uintptr_t>(p.w) % 16 == 0 &&
      (p.cfg.quantized ? (p.cfg.bits == 4 || p.cfg.bits == 8) && gs >= 32 &&
                             (gs & (gs - 1)) == 0 && q4_exact
                       : p.w_dtype == p.h_dtype);
  return p.cfg.tuning.wgmma && dev.compute_capability_major() == 9 &&
      kernels().image(s.device.index).wgmma && weight_ok &&
      (p.h_dtype == mx::bfloat16 || p.h_dtype == mx::float16) && p.H % 8 == 0 &&
      reinterpret_cast<uintptr_t>(p.h) % 16 == 0;
}

// Suffix of a Hopper GEMM kernel: compute type and how B reaches shared memory.
std::string wg_variant(const HeadProblem& p) {
  std::string t = use_f16(p) ? "f16" : "bf16";
  return t + (p.cfg.quantized ? "_q" + std::to_string(p.cfg.bits) : "_dense");
}

// A 2-D TMA descriptor over a row-major [rows, cols] matrix of `type` with
// row stride `pitch` bytes, read in boxes of box_rows x box_cols elements.
// Reads past rows or cols give zeros.
CUtensorMap encode_2d(const void* ptr, CUtensorMapDataType type, int64_t rows, int64_t cols,
                      int64_t pitch, int box_rows, int box_cols, CUtensorMapSwizzle swizzle) {
  CUtensorMap m;
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(pitch)};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(box_cols), static_cast<cuuint32_t>(box_rows)};
  cuuint32_t elem[2] = {1, 1};
  check(cuTensorMapEncodeTiled(&m, type, 2, const_cast<void*>(ptr), dims, strides, box, elem,
                               CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
        "cuTensorMapEncodeTiled");
  return m;
}

// TMA descriptor of a row-major [rows, cols] 16-bit matrix (row stride ld),
// read in boxes of box_rows x 64 with the 128-byte swizzle the wgmma
// descriptors expect.
CUtensorMap tensor_map(const void* ptr, mx::Dtype t, int64_t rows, int64_t cols, int box_rows,
                       int64_t ld = 0) {
  return encode_2d(ptr,
                   t == mx::float16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                    : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                   rows, cols, (ld ? ld : cols) * 2, box_rows, kWgTileK,
                   CU_TENSOR_MAP_SWIZZLE_128B);
}

// TMA descriptor of a quantized W's packed words, [V, H * bits / 32] uint32,
// read in boxes of box_rows rows x box_cols columns of W, swizzled with the
// span of a box row (32, 64 or 128 bytes; tile_load in the kernels).
CUtensorMap packed_map(const HeadProblem& p, int box_rows, int box_cols) {
  const int64_t words = p.H * p.cfg.bits / 32;
  const int row_bytes = box_cols * p.cfg.bits / 8;
  const CUtensorMapSwizzle swizzle = row_bytes == 32   ? CU_TENSOR_MAP_SWIZZLE_32B
                                     : row_bytes == 64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                                       : CU_TENSOR_MAP_SWIZZLE_128B;
  return encode_2d(p.w, CU_TENSOR_MAP_DATA_TYPE_UINT32, p.V, words, words * 4, box_rows,
                   box_cols * p.cfg.bits / 32, swizzle);
}

// On Hopper a quantized head's forward, fused P pass and dh take W as the
// register operand (head_wgmma_rs.cuh) unless tuning.quant_rs = false asks for
// the dequantizing producer. TMA needs 16-byte rows of packed words; the
// scales and biases are 16-bit (fp32 ones take the producer).
bool use_rs(const HeadProblem& p) {
  return p.cfg.quantized && p.cfg.tuning.quant_rs &&
      (p.H * p.cfg.bits / 8) % 16 == 0 && (p.sb_dtype == mx::bfloat16 || p.sb_dtype == mx::float16);
}

void set_pointers(HeadProblem& p, const std::vector<mx::array>& in, size_t scales_at) {
  p.h = mx::gpu_ptr<void>(in[0]);
  p.w = mx::gpu_ptr<void>(in[1]);
  p.targets = mx::gpu_ptr<int32_t>(in[2]);
  if (p.cfg.quantized) {
    p.scales = mx::gpu_ptr<void>(in[scales_at]);
    p.biases = mx::gpu_ptr<void>(in[scales_at + 1]);
    p.sb_dtype = in[scales_at].dtype();
  }
}

// The encoder of s with its device current; fills p's device pointers and
// allocates the outputs.
mx::cu::CommandEncoder& begin(mx::Stream s, HeadProblem& p, const std::vector<mx::array>& inputs,
                              std::vector<mx::array>& outputs, size_t scales_at) {
  auto& enc = mx::cu::get_command_encoder(s);
  mx::cu::device(s.device).make_current();
  set_pointers(p, inputs, scales_at);
  alloc(outputs);
  return enc;
}

// The attributes the launch planning reads, asked once per GPU.
DeviceInfo device_info(int ordinal) {
  static std::mutex mutex;
  static std::unordered_map<int, DeviceInfo> infos;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = infos.find(ordinal);
  if (it == infos.end()) {
    CUdevice dev;
    int sms = 0, l2 = 0;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, ordinal), "cuDeviceGet");
    check(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
          "multiprocessor count");
    check(cuDeviceGetAttribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev), "L2 cache size");
    it = infos.emplace(ordinal, DeviceInfo{sms, l2}).first;
  }
  return it->second;
}

// The launch sizes of p on the GPU of s.
LaunchPlan launch_plan(const mx::Stream& s, const HeadProblem& p) {
  return plan_launch(p.cfg.tuning, device_info(s.device.index));
}

// Width of the vocabulary chunk of the backward and the fused forward for
// blocks of M rows, a multiple of every tile width.
int64_t backward_chunk(const LaunchPlan& plan, int64_t M, int64_t V) {
  return vocab_chunk(plan, M, V, kWgTileN);
}

// Whether the Hopper kernels leave the target logits to gather_targets: the
// register-operand (4/8-bit) ones always, the dense ones unless
// tuning.gather_targets = false.
bool gathers_targets(const mx::Stream& s, const HeadProblem& p) {
  return use_wgmma(s, p) &&
      (use_rs(p) || (!p.cfg.quantized && p.cfg.tuning.gather_targets));
}

// target_logit[m] = the (softcapped) logit of row m's target, for p's rows;
// `out` is the array that holds target_logit.
void gather_targets(mx::cu::CommandEncoder& enc, Launch& launch, const HeadProblem& p,
                    const std::vector<mx::array>& inputs, const mx::array& out,
                    float* target_logit) {
  TargetParams tp{};
  tp.h = dense(p.h, p.h_dtype, p.M, p.H, p.H, compute_dtype(p));
  tp.w = weight(p, compute_dtype(p));
  tp.targets = p.targets;
  tp.target_logit = target_logit;
  tp.M = p.M;
  tp.V = p.V;
  tp.H = p.H;
  tp.cap = p.cfg.softcap;
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(out);
  launch("fcce_target_" + wg_variant(p), cdiv(p.M, kThreads / 32), 0, tp);
}

// The forward GEMM over the vocabulary [0, V_used): per-split row partials
// (max, sum of exp) and, unless gathers_targets, the target logits, in
// parts[2 * splits + 1, M].
std::pair<mx::array, FwdParams> lse_partials(mx::Stream s, const HeadProblem& p,
                                             const std::vector<mx::array>& inputs,
                                             int64_t V_used) {
  auto& enc = mx::cu::get_command_encoder(s);
  const auto ct = compute_dtype(p);
  const bool wg = use_wgmma(s, p);
  const int tile_n = wg ? kWgTileN : kTileN;
  FwdParams fp{};
  fp.h = dense(p.h, p.h_dtype, p.M, p.H, p.H, ct);
  fp.w = weight(p, ct);
  fp.targets = p.targets;
  fp.M = p.M;
  fp.V = V_used;
  fp.H = p.H;
  const bool rs = wg && use_rs(p);
  const int tile_rows = rs ? kRsTileM : kTileM;
  fp.m_tiles = static_cast<int>(cdiv(p.M, tile_rows));
  fp.v_tiles = static_cast<int>(cdiv(V_used, rs ? kRsTileV : tile_n));
  const LaunchPlan plan = launch_plan(s, p);
  fp.splits = forward_splits(plan, p.M, fp.v_tiles, fp.m_tiles);
  fp.tiles_per_split = static_cast<int>(cdiv(fp.v_tiles, fp.splits));
  fp.splits = static_cast<int>(cdiv(fp.v_tiles, fp.tiles_per_split));
  fp.m_group = forward_group(plan, fp.m_tiles, tile_rows, p.H, mx::size_of(p.h_dtype));
  fp.cap = p.cfg.softcap;

  auto parts = scratch(enc, {2 * fp.splits + 1, static_cast<int>(p.M)}, mx::float32);
  fp.part_max = mx::gpu_ptr<float>(parts);
  fp.part_sum = fp.part_max + int64_t(fp.splits) * p.M;
  fp.target_logit = fp.part_sum + int64_t(fp.splits) * p.M;

  Launch launch{enc, s.device.index};
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(parts);
  // Kernels whose targets come from gather_targets (forward) find none here.
  FwdParams kp = fp;
  if (gathers_targets(s, p)) {
    kp.target_logit = nullptr;
  }
  if (rs) {
    WgFwdParams wp{};
    wp.h_map = tensor_map(p.h, p.h_dtype, p.M, p.H, kRsTileM);
    wp.w_map = packed_map(p, kRsTileV, kWgTileK);
    wp.p = kp;
    launch("fcce_fwd_rs_" + wg_variant(p), int64_t(fp.m_tiles) * fp.splits, kRsSmemBytes, wp,
           kWgThreads);
  } else if (wg) {
    WgFwdParams wp{};
    wp.h_map = tensor_map(p.h, p.h_dtype, p.M, p.H, kWgTileM);
    if (!p.cfg.quantized) {
      wp.w_map = tensor_map(p.w, p.w_dtype, p.V, p.H, kWgTileN);
    }
    wp.p = kp;
    launch("fcce_fwd_wg_" + wg_variant(p),
           int64_t(fp.m_tiles) * fp.splits, kWgSmemBytes, wp, kWgThreads);
  } else {
    launch("fcce_fwd_" + variant(p), int64_t(fp.m_tiles) * fp.splits, kSmemBytes, fp);
  }
  return {parts, fp};
}

// Rows [r0, r0 + rows) of p as a problem of their own.
HeadProblem row_slice(const HeadProblem& p, int64_t r0, int64_t rows) {
  HeadProblem q = p;
  q.M = rows;
  q.h = static_cast<const char*>(p.h) + r0 * p.H * mx::size_of(p.h_dtype);
  q.targets = p.targets + r0;
  return q;
}

// Width of the fused forward's row-sum tiles: the P kernel's vocabulary tile.
int64_t stats_tile_width(bool wgmma, bool rs) {
  return !wgmma ? kTileN : rs ? kRsTileV : kWgTileN;
}

// The dh kernels' DhSplit flags (at most one per multiprocessor), zeroed once
// per call: each split tile's last piece sets its flag back to 0.
mx::array split_flags(mx::Stream s, mx::cu::CommandEncoder& enc, const HeadProblem& p) {
  if (!use_wgmma(s, p)) {
    return mx::array(0);
  }
  const int n = device_info(s.device.index).sms;
  auto flags = scratch(enc, {n}, mx::int32);
  ZeroParams z{mx::gpu_ptr<int32_t>(flags), n};
  enc.set_output_array(flags);
  Launch{enc, s.device.index}("fcce_zero", 1, 0, z);
  return flags;
}

// The vocabulary-chunked passes of the backward and of the fused forward: per
// chunk, one kernel writes dS (or P) of the chunk to an [M, chunk] buffer and
// a second adds buffer @ W[chunk] into the fp32 [M, H] accumulator.
class ChunkPasses {
 public:
  // p: the rows of this block; acc: the fp32 accumulator, whose row 0 for this
  // block is at float acc_at; buf: an [at least p.M, chunk] buffer; flags:
  // from split_flags.
  ChunkPasses(mx::Stream s, mx::cu::CommandEncoder& enc, const HeadProblem& p,
              const std::vector<mx::array>& inputs, mx::array acc, int64_t acc_at,
              mx::array buf, int64_t chunk, mx::array flags)
      : enc_(enc), launch_{enc, s.device.index}, p_(p), inputs_(inputs), acc_(std::move(acc)),
        buf_(std::move(buf)), flags_(std::move(flags)) {
    const auto ct = compute_dtype(p);
    M_ = p.M;
    chunk_ = chunk;
    wg_ = use_wgmma(s, p);
    plan_ = launch_plan(s, p);
    sms_ = plan_.sms;
    m_tiles_ = static_cast<int>(cdiv(M_, kTileM));

    ds_.h = dense(p.h, p.h_dtype, M_, p.H, p.H, ct);
    ds_.w = weight(p, ct);
    ds_.targets = p.targets;
    ds_.ds = mx::gpu_ptr<void>(buf_);
    ds_.M = M_;
    ds_.V = p.V;
    ds_.H = p.H;
    ds_.ld_ds = chunk_;
    ds_.m_tiles = m_tiles_;
    ds_.ignore_index = p.cfg.ignore_index;
    ds_.cap = p.cfg.softcap;

    dh_.ds = dense(ds_.ds, ct, M_, 0, chunk_, ct);
    dh_.w = weight(p, ct);
    dh_.acc = mx::gpu_ptr<float>(acc_) + acc_at;
    dh_.M = M_;
    dh_.H = p.H;
    dh_.m_tiles = m_tiles_;
    if (wg_) {
      wg_ds_.h_map = tensor_map(p.h, p.h_dtype, M_, p.H, kWgTileM);
      if (!p.cfg.quantized) {  // else the producers dequantize W
        wg_ds_.w_map = tensor_map(p.w, p.w_dtype, p.V, p.H, kWgTileN);
        wg_dh_.b_map = tensor_map(p.w, p.w_dtype, p.V, p.H, 64);
      }
      rs_ = use_rs(p);
      if (rs_) {
        wg_dh_.b_map = packed_map(p, kWgTileK, kRsTileV);
        rs_p_.h_map = tensor_map(p.h, p.h_dtype, M_, p.H, kRsTileM);
        rs_p_.w_map = packed_map(p, kRsTileV, kWgTileK);
      }
    }
  }

  DsParams& ds() { return ds_; }
  DhParams& dh() { return dh_; }
  Launch& launch() { return launch_; }
  bool wgmma() const { return wg_; }
  // Vocabulary tiles of the first kernel in one chunk (its row-sum partials).
  int64_t tiles(int64_t width) const { return cdiv(width, stats_tile_width(wg_, rs_)); }

  // The first kernel on chunk [v0, v0 + width): dS, or P in the fused forward.
  void first(int64_t v0, int64_t width, const std::vector<mx::array>& outs) {
    ds_.v0 = v0;
    ds_.width = width;
    for (auto& a : inputs_) {
      enc_.set_input_array(a);
    }
    enc_.set_output_array(buf_);
    for (auto& a : outs) {
      enc_.set_output_array(a);
    }
    if (rs_ && ds_.part_sum) {
      rs_p_.p = ds_;
      launch_("fcce_p_rs_" + wg_variant(p_),
              std::min<int64_t>(cdiv(M_, kRsTileM) * cdiv(width, kRsTileV), sms_), kRsPSmemBytes,
              rs_p_, kWgThreads);
    } else if (wg_) {
      wg_ds_.p = ds_;
      launch_((ds_.part_sum ? "fcce_p_wg_" : "fcce_ds_wg_") + wg_variant(p_), std::min<int64_t>(m_tiles_ * tiles(width), sms_),
              kWgSmemBytes, wg_ds_, kWgThreads);
    } else {
      launch_("fcce_ds_" + variant(p_), m_tiles_ * tiles(width), kSmemBytes, ds_);
    }
  }

  // acc (+)= buffer @ W[v0 : v0 + width]: the weight rows are the K dimension.
  void second(int64_t v0, int64_t width, const std::vector<mx::array>& outs) {
    dh_.ds.cols = width;
    dh_.w.row0 = v0;
    dh_.first = v0 == 0;
    enc_.set_input_array(inputs_[1]);
    if (p_.cfg.quantized) {
      enc_.set_input_array(inputs_[inputs_.size() - 2]);
      enc_.set_input_array(inputs_.back());
    }
    // The next chunk overwrites the buffer: mark it written here so that the
    // graph orders that write after this read.
    enc_.set_output_array(buf_);
    enc_.set_output_array(acc_);
    for (auto& a : outs) {
      enc_.set_output_array(a);
    }
    if (wg_) {
      const int64_t tile_rows = rs_ ? kRsTileM : kWgTileM;
      const int64_t tiles = cdiv(M_, tile_rows) * cdiv(p_.H, rs_ ? kRsTileV : kWgTileN);
      enc_.set_output_array(flags_);
      wg_dh_.a_map = tensor_map(ds_.ds, compute_dtype(p_), M_, width, tile_rows, chunk_);
      wg_dh_.p = dh_;
      wg_dh_.v0 = v0;
      wg_dh_.width = width;
      wg_dh_.split = dh_split(tiles, width);
      launch_((rs_ ? "fcce_dh_rs_" : "fcce_dh_wg_") + wg_variant(p_),
              std::min<int64_t>(dh_units(wg_dh_.split), sms_),
              rs_ ? kRsDhSmemBytes : kWgSmemBytes, wg_dh_, kWgThreads);
    } else {
      launch_("fcce_dh_" + variant(p_), int64_t(m_tiles_) * cdiv(p_.H, kTileN), kSmemBytes,
              dh_);
    }
  }

 private:
  // The split of the last round of a dh launch over `tiles` output tiles.
  // plan_.dh_splits caps the pieces a tile (1: none).
  DhSplit dh_split(int64_t tiles, int64_t width) {
    DhSplit sp{};
    sp.flags = mx::gpu_ptr<int32_t>(flags_);
    plan_dh_split(sp, static_cast<int>(tiles), sms_, static_cast<int>(cdiv(width, kWgTileK)),
                  plan_.dh_splits, 4);
    return sp;
  }

  mx::cu::CommandEncoder& enc_;
  Launch launch_;
  HeadProblem p_;
  LaunchPlan plan_;
  const std::vector<mx::array>& inputs_;
  mx::array acc_;
  mx::array buf_;
  mx::array flags_;
  int64_t M_ = 0, chunk_ = 0;
  int m_tiles_ = 0, sms_ = 0;
  bool wg_ = false, rs_ = false;
  DsParams ds_{};
  DhParams dh_{};
  WgDsParams wg_ds_{}, rs_p_{};
  WgDhParams wg_dh_{};
};

// The fused forward: per vocabulary chunk, P = exp(s - r) dcap and the row
// sums of exp(s - r), then gsum (+)= P @ W[chunk]; fcce_finish turns the sums
// into lse and logp and rescales gsum to softmax weights. Two GEMMs for
// forward + backward, where the plain forward + backward takes three.
//
// The row reference r: with a softcap <= kMaxFixedCap, the cap itself (an
// upper bound of every logit). Otherwise a running one: the exact row maxima
// of the first chunk (one extra chunk-wide GEMM), raised to the maximum of the
// chunks seen so far when that passes it by more than kRefStep, with acc and
// the sums rescaled then. A chunk whose logits outrun their reference by more
// than kMaxRefGap raises a flag, and a second pass, which does nothing unless
// the flag is set, redoes the chunks against the exact row maxima.
void forward_fused(mx::Stream s, const HeadProblem& p, const std::vector<mx::array>& inputs,
                   std::vector<mx::array>& outputs) {
  auto& enc = mx::cu::get_command_encoder(s);
  const LaunchPlan plan = launch_plan(s, p);
  const int64_t H = p.H, block = row_block(plan, p.M), chunk = backward_chunk(plan, block, p.V);
  const bool wg = use_wgmma(s, p);
  const int64_t tiles = cdiv(chunk, stats_tile_width(wg, wg && use_rs(p)));
  const bool fixed = p.cfg.softcap > 0.0f && p.cfg.softcap <= kMaxFixedCap;
  auto buf = scratch(enc, {static_cast<int>(block), static_cast<int>(chunk)}, compute_dtype(p));
  // Per row block: part_sum[tiles, rows], run_sum[rows], target_logit[rows];
  // running reference only: part_max[tiles, rows], three rotating ref[rows]
  // and the flag.
  const int64_t stats = tiles + 2 + (fixed ? 0 : tiles + 7);
  auto sums = scratch(enc, {static_cast<int>(stats), static_cast<int>(block)}, mx::float32);
  auto flags = split_flags(s, enc, p);
  const bool gather = gathers_targets(s, p);
  for (int64_t r0 = 0; r0 < p.M; r0 += block) {
    const int64_t M = std::min(block, p.M - r0);
    const HeadProblem pr = row_slice(p, r0, M);
    ChunkPasses passes(s, enc, pr, inputs, outputs[2], r0 * H, buf, chunk, flags);
    float* part_sum = mx::gpu_ptr<float>(sums);
    float* run_sum = part_sum + tiles * M;
    float* target_logit = run_sum + M;
    float* part_max = fixed ? nullptr : target_logit + M;
    float* ref[3] = {nullptr, nullptr, nullptr};
    int32_t* flag = nullptr;
    if (!fixed) {
      // References at an even offset and stride (part_max + tiles M is
      // part_sum + 2 (tiles + 1) M): the 4/8-bit P epilogue loads two rows'
      // at once. Three spare rows of `stats` keep the flag inside for odd M.
      const int64_t stride = M + (M & 1);
      for (int i = 0; i < 3; ++i) {
        ref[i] = part_max + tiles * M + i * stride;
      }
      flag = reinterpret_cast<int32_t*>(part_max + tiles * M + 3 * stride);
      // The first chunk's exact row maxima.
      auto [pre, fp] = lse_partials(s, pr, inputs, std::min(chunk, p.V));
      RowMaxParams rp{};
      rp.part_max = fp.part_max;
      rp.ref = ref[0];
      rp.flag = flag;
      rp.M = M;
      rp.splits = fp.splits;
      enc.set_input_array(pre);
      enc.set_output_array(sums);
      passes.launch()("fcce_row_max", cdiv(M, kThreads), 0, rp);
    }
    if (gather) {
      gather_targets(enc, passes.launch(), pr, inputs, sums, target_logit);
    }
    auto& ds = passes.ds();
    auto& dh = passes.dh();
    ds.part_sum = part_sum;
    ds.target_logit = gather ? nullptr : target_logit;
    ds.part_max = part_max;
    ds.flag = flag;
    dh.part_sum = part_sum;
    dh.run_sum = run_sum;
    dh.part_max = part_max;
    int k = 0;
    for (int64_t v0 = 0; v0 < p.V; v0 += chunk, ++k) {
      const int64_t width = std::min(chunk, p.V - v0);
      ds.ref = ref[k % 3];
      dh.ref_prev = ref[(k + 2) % 3];
      dh.ref_cur = ref[k % 3];
      dh.ref_next = ref[(k + 1) % 3];
      dh.sum_tiles = static_cast<int>(passes.tiles(width));
      passes.first(v0, width, {sums});
      passes.second(v0, width, {sums});
    }
    const float* last_ref = ref[(k + 2) % 3];
    const float* exact = ref[k % 3];
    if (!fixed) {
      ds.ref = exact;
      ds.part_max = nullptr;
      ds.guard = flag;
      dh.ref_prev = nullptr;
      dh.part_max = nullptr;
      dh.guard = flag;
      for (int64_t v0 = 0; v0 < p.V; v0 += chunk) {
        const int64_t width = std::min(chunk, p.V - v0);
        dh.sum_tiles = static_cast<int>(passes.tiles(width));
        passes.first(v0, width, {sums});
        passes.second(v0, width, {sums});
      }
    }

    FinishParams fp{};
    fp.run_sum = run_sum;
    fp.target_logit = target_logit;
    fp.targets = pr.targets;
    fp.ref = last_ref;
    fp.ref_exact = exact;
    fp.flag = flag;
    fp.logp = mx::gpu_ptr<float>(outputs[0]) + r0;
    fp.lse = mx::gpu_ptr<float>(outputs[1]) + r0;
    fp.gsum = mx::gpu_ptr<float>(outputs[2]) + r0 * H;
    fp.M = M;
    fp.V = p.V;
    fp.H = H;
    fp.cap = p.cfg.softcap;
    fp.ignore_index = p.cfg.ignore_index;
    enc.set_input_array(sums);
    enc.set_input_array(inputs[2]);
    enc.set_output_array(sums);  // the next row block reuses it
    for (auto& o : outputs) {
      enc.set_output_array(o);
    }
    passes.launch()("fcce_finish", M, 0, fp);
  }
}

} // namespace

void forward(mx::Stream s, const HeadProblem& prob, const std::vector<mx::array>& inputs,
             std::vector<mx::array>& outputs) {
  HeadProblem p = prob;
  auto& enc = begin(s, p, inputs, outputs, 3);
  if (outputs.size() == 3) {
    forward_fused(s, p, inputs, outputs);
    return;
  }
  auto [parts, fp] = lse_partials(s, p, inputs, p.V);
  Launch launch{enc, s.device.index};
  if (gathers_targets(s, p)) {
    gather_targets(enc, launch, p, inputs, parts, fp.target_logit);
  }

  CombineParams cp{};
  cp.part_max = fp.part_max;
  cp.part_sum = fp.part_sum;
  cp.target_logit = fp.target_logit;
  cp.targets = p.targets;
  cp.logp = mx::gpu_ptr<float>(outputs[0]);
  cp.lse = mx::gpu_ptr<float>(outputs[1]);
  cp.M = p.M;
  cp.V = p.V;
  cp.splits = fp.splits;
  cp.ignore_index = p.cfg.ignore_index;
  enc.set_input_array(parts);
  enc.set_input_array(inputs[2]);
  enc.set_output_array(outputs[0]);
  enc.set_output_array(outputs[1]);
  launch("fcce_combine", cdiv(p.M, kThreads), 0, cp);
}

void backward(mx::Stream s, const HeadProblem& prob, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs) {
  HeadProblem p = prob;
  auto& enc = begin(s, p, inputs, outputs, 6);
  const bool want_dw = outputs.size() > 1;
  const auto ct = compute_dtype(p);
  const int64_t H = p.H, V = p.V;
  // dW sums over every row per chunk: one block of all rows then.
  const LaunchPlan plan = launch_plan(s, p);
  const int64_t block = want_dw ? p.M : row_block(plan, p.M);
  const int64_t chunk = backward_chunk(plan, block, V);
  auto buf = scratch(enc, {static_cast<int>(block), static_cast<int>(chunk)}, ct);
  // fp32 dh accumulates in the output itself; other dtypes need an fp32 buffer
  // (one row block's, reused).
  const bool acc_in_out = p.h_dtype == mx::float32;
  mx::array acc = acc_in_out
      ? outputs[0]
      : scratch(enc, {static_cast<int>(block), static_cast<int>(H)}, mx::float32);
  const std::string t = use_f16(p) ? "f16" : "bf16";
  auto flags = split_flags(s, enc, p);
  for (int64_t r0 = 0; r0 < p.M; r0 += block) {
    const int64_t M = std::min(block, p.M - r0);
    const HeadProblem pr = row_slice(p, r0, M);
    ChunkPasses passes(s, enc, pr, inputs, acc, acc_in_out ? r0 * H : 0, buf, chunk, flags);
    passes.ds().lse = mx::gpu_ptr<float>(inputs[3]) + r0;
    passes.ds().g = mx::gpu_ptr<float>(inputs[4]) + r0;
    passes.ds().g_lse = mx::gpu_ptr<float>(inputs[5]) + r0;
    passes.dh().out =
        static_cast<char*>(mx::gpu_ptr<void>(outputs[0])) + r0 * H * mx::size_of(p.h_dtype);
    passes.dh().out_kind = src_kind(p.h_dtype);

    DwParams wp{};
    WgDwParams wwp{};
    if (want_dw) {
      wp.ds = dense(mx::gpu_ptr<void>(buf), ct, M, 0, chunk, ct);
      wp.h = dense(pr.h, p.h_dtype, M, H, H, ct);
      wp.out = mx::gpu_ptr<void>(outputs[1]);
      wp.M = M;
      wp.H = H;
      wp.out_kind = src_kind(p.w_dtype);
      if (passes.wgmma()) {
        wwp.b_map = tensor_map(pr.h, p.h_dtype, M, H, 64);
      }
    }
    for (int64_t v0 = 0; v0 < V; v0 += chunk) {
      const int64_t width = std::min(chunk, V - v0);
      passes.first(v0, width, {});
      passes.dh().last = v0 + width >= V;
      passes.second(v0, width, {outputs[0]});
      if (!want_dw) {
        continue;
      }
      // dS^T: the dS buffer read as [k = m][v], h as [k = m][h].
      const int64_t v_tiles = cdiv(width, kTileN);
      wp.ds.cols = width;
      wp.v0 = v0;
      wp.width = width;
      wp.v_tiles = static_cast<int>(v_tiles);
      enc.set_input_array(inputs[0]);
      enc.set_output_array(buf);
      enc.set_output_array(outputs[1]);
      if (passes.wgmma()) {
        wwp.a_map = tensor_map(wp.ds.ptr, ct, M, width, 64, chunk);
        wwp.p = wp;
        passes.launch()("fcce_dw_wg_" + t, v_tiles * cdiv(H, kWgTileN), kWgSmemBytes, wwp,
                        kWgThreads);
      } else {
        passes.launch()("fcce_dw_" + t, v_tiles * cdiv(H, kTileN), kSmemBytes, wp);
      }
    }
  }
}

void fused_dh(mx::Stream s, const HeadProblem& prob, const std::vector<mx::array>& inputs,
              std::vector<mx::array>& outputs) {
  HeadProblem p = prob;
  auto& enc = begin(s, p, inputs, outputs, 7);
  FusedDhParams fp{};
  fp.w = weight(p, mx::float32); // fp32 compute type: every dense kind reads as itself
  fp.targets = p.targets;
  fp.gsum = mx::gpu_ptr<float>(inputs[0]);
  fp.logp = mx::gpu_ptr<float>(inputs[3]);
  fp.lse = mx::gpu_ptr<float>(inputs[4]);
  fp.g = mx::gpu_ptr<float>(inputs[5]);
  fp.g_lse = mx::gpu_ptr<float>(inputs[6]);
  fp.out = mx::gpu_ptr<void>(outputs[0]);
  fp.M = p.M;
  fp.V = p.V;
  fp.H = p.H;
  fp.cap = p.cfg.softcap;
  fp.ignore_index = p.cfg.ignore_index;
  fp.out_kind = src_kind(p.h_dtype);
  for (auto& a : inputs) {
    enc.set_input_array(a);
  }
  enc.set_output_array(outputs[0]);
  Launch{enc, s.device.index}("fcce_fused_dh", p.M, 0, fp);
}

std::string kernel_image(int ordinal) {
  const Image& im = kernels().image(ordinal);
  auto sm = [](int v) { return std::to_string(v); };
  std::string out = "device sm_" + sm(im.device) + ", image ";
  out += im.jit ? "compute_" + sm(im.arch / 10) + " PTX, JIT-compiled to sm_" + sm(im.binary)
                : "sm_" + sm(im.binary) + (im.wgmma ? "a" : "") + " SASS";
  out += im.wgmma ? ", Hopper kernels" : ", portable kernels";
  return out;
}

std::vector<std::pair<std::string, int64_t>> launch_plan_items(int ordinal,
                                                               const HeadTuning& tuning) {
  const DeviceInfo d = device_info(ordinal);
  const LaunchPlan plan = plan_launch(tuning, d);
  return {{"sms", d.sms},
          {"l2_bytes", d.l2_bytes},
          {"row_block", plan.row_block},
          {"chunk_bytes", plan.chunk_bytes},
          {"vocab_chunk", plan.vocab_chunk},
          {"fwd_l2_bytes", plan.fwd_l2_bytes},
          {"dh_splits", plan.dh_splits}};
}

} // namespace flash_cce::cuda
