// cutlass-byoc: the CUDA kernels of the offloaded call-site ops (cutlass_byoc::fprop_site, ::dgrad_site,
// ::wgrad_site), i.e. the per-call launch path of a compiled graph, in C++.
//
// Built and loaded by cutlass_byoc/offload/native.py against the running torch (torch.utils.cpp_extension); the op
// schemas, their fake (meta) implementations and the Python implementations are in cutlass_byoc/offload/library.py.
//
// A call site's launch is chosen and prepared in Python when the site is first called (CallSite.bind: the problem,
// the kernel library, the argument block, the workspace size, the output's shape and strides). Python then hands
// this file a SiteSpec (cb_site_set). Every later call of the site runs here: it checks the operands against the
// spec (shapes, dtypes, channels_last layout, device, pointer alignment), allocates the output and the workspace
// from PyTorch's caching allocator, fills the pointers into a copy of the argument block and calls the library's
// cb_run on the current stream. No Python runs, nothing synchronizes, nothing persists between calls (safe to
// capture in CUDA graphs). A site whose graph has a symbolic batch size gets one spec per batch size met
// (cb_site_add), and a call runs on the first whose checks it passes.
//
// Whatever the fast path cannot take (a site not bound yet, or bound to the general path; operands that differ
// from the spec; the native path switched off) is redispatched to the op's Python twin (cutlass_byoc::*_site_py),
// which binds the site, or runs the general path that checks everything: nothing unchecked reaches a kernel.
//
// wgrad on a side stream (cutlass_byoc::wgrad_site_async, OffloadOptions.overlap_wgrad): a weight gradient is off
// the backward pass's critical path (nothing in the step reads it before the optimizer), so a chain of these calls
// launches each one on a side stream forked from the current one, where it runs beside the next layers' data
// gradients and batch-norm backward, and joins it back at a later call of the chain (the current stream waits on
// its event). Memory stays safe because the partitioner hands each call the operands and output of the calls it
// joins (`after`): the compiled graph keeps those tensors alive, unread and unreused, until that call, and the call
// itself holds them (and the workspace) until its join; outputs and workspaces are allocated on the current stream
// before the fork, so the side stream writes only memory whose earlier users it has waited for. The chain's last call
// (overlap 0) joins everything and runs on the current stream: a graph returns, or ends its CUDA graph capture, with
// nothing in flight. A call the fast path cannot take joins everything before its Python twin runs.
//
// Only libc10 / libtorch_cpu symbols are used (the current CUDA stream is read through c10's device-guard
// interface), so the same source builds against CPU and CUDA builds of torch. Built with CB_SITES_TEST_CPU (the CPU
// tests only), the kernels are registered for CPU tensors instead, and launch with a null stream.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <array>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

// int cb_run(const CbConv2dArgs* args, void* workspace, int64_t workspace_bytes, void* stream, char* msg, int len)
using RunFn = int (*)(const void*, void*, int64_t, void*, char*, int);

constexpr int kMaxArgsBytes = 512;
#ifdef CB_SITES_TEST_CPU
constexpr bool kCpu = true;
#else
constexpr bool kCpu = false;
#endif

// Mirror of class SiteSpec in cutlass_byoc/offload/native.py (ctypes): plain integers only.
struct SiteSpec {
  int64_t abi;              // kSpecAbi
  void* run;                // the kernel library's cb_run
  const void* args;         // the prepared CbConv2dArgs (copied here)
  int64_t args_bytes;
  int64_t off_a, off_b, off_d, off_source, off_bias;  // byte offsets of the pointer fields in the block
  int64_t workspace_bytes;
  int64_t align_a, align_b, align_source, align_bias;  // byte alignments the kernel needs
  int64_t a_shape[4], b_shape[4];                      // logical NCHW / KCRS sizes
  int64_t dt_a, dt_b, dt_out;                          // c10::ScalarType codes
  int64_t out_size[4], out_stride[4];
  int64_t source_dim;       // -1: no epilogue source; 1: a (K,) bias; 4: a residual (channels_last)
  int64_t source_shape[4];
  int64_t dt_source;
  int64_t bias_len;         // bias and residual: the bias's length (K); -1: no second pointer
  int64_t dt_bias;
};
constexpr int64_t kSpecAbi = 1;

struct Site {
  SiteSpec spec;
  std::array<uint8_t, kMaxArgsBytes> args;
  c10::ScalarType dt_a, dt_b, dt_out, dt_source, dt_bias;
  std::string name;
  std::atomic<int64_t> calls{0};
  // A site with a symbolic batch size (a dynamic graph) has one binding per batch size met: the newest first, each
  // with the operand shapes of its own problem; a call takes the first whose checks it passes.
  std::shared_ptr<Site> next;
};
constexpr int kMaxVariants = 8;  // bindings kept per site (the oldest dropped: its calls take the Python twin)

// Sites are only ever added (one per offloaded call of a compiled graph) and replaced whole; readers take a
// shared_ptr copy under a mutex held for a few instructions. A site's chain of bindings is immutable once
// published (a new binding is a new head pointing at the old chain).
std::mutex g_mutex;
std::vector<std::shared_ptr<Site>> g_sites;
std::atomic<bool> g_enabled{true};

std::shared_ptr<Site> find_site(int64_t index) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (index < 0 || index >= static_cast<int64_t>(g_sites.size())) return nullptr;
  return g_sites[index];
}

bool shape_is(const at::Tensor& t, const int64_t* shape, int64_t dim) {
  if (t.dim() != dim) return false;
  auto sizes = t.sizes();
  for (int64_t i = 0; i < dim; ++i)
    if (sizes[i] != shape[i]) return false;
  return true;
}

bool aligned(const void* p, int64_t align) {
  return p != nullptr && (align <= 1 || reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(align) == 0);
}

bool operand_ok(const at::Tensor& t, const at::Device& dev, const int64_t* shape, c10::ScalarType dt,
                int64_t align) {
  return t.device() == dev && t.scalar_type() == dt && shape_is(t, shape, 4) &&
         t.is_contiguous(at::MemoryFormat::ChannelsLast) && aligned(t.const_data_ptr(), align);
}

// The site's argument block with one call's pointers filled in (bias: the second pointer, only where the site has one).
std::array<uint8_t, kMaxArgsBytes> args_for(const Site& site, const void* a, const void* b, void* d,
                                            const void* source, const void* bias) {
  const SiteSpec& sp = site.spec;
  std::array<uint8_t, kMaxArgsBytes> args = site.args;
  auto put = [&](int64_t off, const void* p) { std::memcpy(args.data() + off, &p, sizeof(void*)); };
  put(sp.off_a, a);
  put(sp.off_b, b);
  put(sp.off_d, d);
  put(sp.off_source, source);
  if (bias) put(sp.off_bias, bias);
  return args;
}

// ------------------------------------------------------------------------------ the side stream (overlap_wgrad)
struct Pending {
  void* event = nullptr;         // recorded on the side stream after the launch
  std::vector<at::Tensor> held;  // the launch's operands, output and workspace, kept until it is joined
};

struct SideStream {
  std::mutex m;
  std::optional<c10::Stream> side;  // one stream of the pool per device, taken at the first async call
  std::deque<Pending> pending;      // launched on the side stream and not joined yet, oldest first
  std::vector<void*> free_events;   // the events of joined launches, reused
  void* fork_event = nullptr;       // recorded on the current stream before each side launch
};
constexpr int kMaxDevices = 64;
SideStream g_side[kMaxDevices];

const c10::impl::DeviceGuardImplInterface* cuda_impl() {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
}

// The current stream waits for all but the newest `keep` pending launches (their held tensors are released).
void join_locked(SideStream& st, const c10::Stream& current, size_t keep) {
  while (st.pending.size() > keep) {
    Pending& p = st.pending.front();
    cuda_impl()->block(p.event, current);
    st.free_events.push_back(p.event);
    st.pending.pop_front();
  }
}

// The side-stream state of a CUDA device (nullptr on the CPU build, or for a device index out of range).
SideStream* side_state(const at::Device& dev) {
  return !kCpu && dev.is_cuda() && dev.index() >= 0 && dev.index() < kMaxDevices ? &g_side[dev.index()] : nullptr;
}

// Join every pending launch of `dev` into its current stream (a no-op when none is pending).
void join_all(const at::Device& dev) {
  SideStream* st = side_state(dev);
  if (!st) return;
  std::lock_guard<std::mutex> lock(st->m);
  if (!st->pending.empty()) join_locked(*st, cuda_impl()->getStream(dev), 0);
}

// The launch of one call, or nullopt when the operands do not match the site's spec. `overlap` < 0: on the current
// stream; 0: the same, after joining every pending side launch (the chain's last call); n > 0: on the side stream,
// with at most n launches of the chain in flight there (the older ones joined first).
std::optional<at::Tensor> launch(Site& site, const at::Tensor& a, const at::Tensor& b,
                                 const std::optional<at::Tensor>& source, const std::optional<at::Tensor>& bias,
                                 int64_t overlap = -1) {
  const SiteSpec& sp = site.spec;
  const at::Device dev = a.device();
  if (dev.is_cuda() == kCpu) return std::nullopt;
  if (!operand_ok(a, dev, sp.a_shape, site.dt_a, sp.align_a)) return std::nullopt;
  if (!operand_ok(b, dev, sp.b_shape, site.dt_b, sp.align_b)) return std::nullopt;
  const void* p_source = nullptr;
  if (sp.source_dim > 0) {
    if (!source.has_value()) return std::nullopt;
    const at::Tensor& s = *source;
    if (s.device() != dev || s.scalar_type() != site.dt_source || !shape_is(s, sp.source_shape, sp.source_dim))
      return std::nullopt;
    if (!(sp.source_dim == 4 ? s.is_contiguous(at::MemoryFormat::ChannelsLast) : s.is_contiguous()))
      return std::nullopt;
    p_source = s.const_data_ptr();
    if (!aligned(p_source, sp.align_source)) return std::nullopt;
  } else if (source.has_value()) {
    return std::nullopt;
  }
  const void* p_bias = nullptr;
  if (sp.bias_len >= 0) {
    if (!bias.has_value()) return std::nullopt;
    const at::Tensor& t = *bias;
    if (t.device() != dev || t.scalar_type() != site.dt_bias || t.dim() != 1 || t.size(0) != sp.bias_len ||
        !t.is_contiguous())
      return std::nullopt;
    p_bias = t.const_data_ptr();
    if (!aligned(p_bias, sp.align_bias)) return std::nullopt;
  } else if (bias.has_value()) {
    return std::nullopt;
  }

  const auto options = at::TensorOptions().dtype(site.dt_out).device(dev);
  at::Tensor out = at::empty_strided(c10::IntArrayRef(sp.out_size, 4), c10::IntArrayRef(sp.out_stride, 4), options);
  const auto args = args_for(site, a.const_data_ptr(), b.const_data_ptr(), out.data_ptr(), p_source, p_bias);
  // the workspace comes from the caching allocator and is dead after the call: safe under CUDA graph capture
  at::Tensor workspace;
  void* ws = nullptr;
  if (sp.workspace_bytes > 0) {
    workspace = at::empty({sp.workspace_bytes}, options.dtype(at::kByte));
    ws = workspace.data_ptr();
  }
  std::optional<c10::DeviceGuard> guard;
  void* stream = nullptr;
  SideStream* st = overlap >= 0 ? side_state(dev) : nullptr;  // a call of an overlapped chain
  std::unique_lock<std::mutex> lock;
  bool to_side = false;
  if (!kCpu) {
    guard.emplace(dev);  // sets the device only when it is not the current one
    const c10::Stream current = cuda_impl()->getStream(dev);
    stream = current.native_handle();
    if (st) {
      lock = std::unique_lock<std::mutex>(st->m);
      if (overlap > 0 && !st->side) st->side = cuda_impl()->getStreamFromGlobalPool(dev, /*isHighPriority=*/false);
      // on the side stream unless this is the chain's last call (or the pool's stream is the current one)
      to_side = overlap > 0 && *st->side != current;
      join_locked(*st, current, to_side ? static_cast<size_t>(overlap - 1) : 0);
      if (to_side) {
        // fork: the side stream waits for everything issued so far on the current one (the operands' producers,
        // the earlier users of the output's and workspace's memory)
        cuda_impl()->record(&st->fork_event, current, dev.index(), c10::EventFlag::PYTORCH_DEFAULT);
        cuda_impl()->block(st->fork_event, *st->side);
        stream = st->side->native_handle();
      } else {
        lock.unlock();  // in line: nothing of the state is touched again
      }
    }
  }
  char msg[256] = {0};
  const int rc = reinterpret_cast<RunFn>(sp.run)(args.data(), ws, sp.workspace_bytes, stream, msg, sizeof(msg));
  TORCH_CHECK(rc == 0, site.name, ": ", msg);
  if (to_side) {  // pending until a later call of the chain joins it
    Pending p;
    if (!st->free_events.empty()) {
      p.event = st->free_events.back();
      st->free_events.pop_back();
    }
    cuda_impl()->record(&p.event, *st->side, dev.index(), c10::EventFlag::PYTORCH_DEFAULT);
    p.held = {a, b, out};
    if (workspace.defined()) p.held.push_back(workspace);
    st->pending.push_back(std::move(p));
  }
  site.calls.fetch_add(1, std::memory_order_relaxed);
  return out;
}

c10::OperatorHandle python_twin(const char* name) {
  // the op's Python implementation (binds the site, or runs the general path)
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor fprop_site(const at::Tensor& input, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& residual, int64_t index) {
  if (g_enabled.load(std::memory_order_relaxed)) {
    if (auto site = find_site(index)) {
      // the epilogue source is the residual when there is one (then the bias is the second pointer), else the bias
      for (Site* s = site.get(); s; s = s->next.get()) {
        auto y = residual.has_value() ? launch(*s, input, weight, residual, bias)
                                      : launch(*s, input, weight, bias, std::nullopt);
        if (y) return *y;
      }
    }
  }
  static const auto twin = python_twin("cutlass_byoc::fprop_site_py")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                        const std::optional<at::Tensor>&, int64_t)>();
  return twin.call(input, weight, bias, residual, index);
}

// dgrad (grad_output, weight) and wgrad (grad_output, input): two operands, no epilogue source
template <const char* kTwin>
at::Tensor two_operand_site(const at::Tensor& a, const at::Tensor& b, int64_t index) {
  if (g_enabled.load(std::memory_order_relaxed)) {
    if (auto site = find_site(index)) {
      for (Site* s = site.get(); s; s = s->next.get())
        if (auto y = launch(*s, a, b, std::nullopt, std::nullopt)) return *y;
    }
  }
  static const auto twin = python_twin(kTwin).typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  return twin.call(a, b, index);
}

constexpr char kDgradTwin[] = "cutlass_byoc::dgrad_site_py";
constexpr char kWgradTwin[] = "cutlass_byoc::wgrad_site_py";

// wgrad of a chain of overlapped calls (see the header): `overlap` n > 0 launches on the side stream with at most n
// in flight; 0 joins them all and runs on the current stream. `after` only orders the call (the partitioner's).
at::Tensor wgrad_site_async(const at::Tensor& a, const at::Tensor& b, int64_t index, int64_t overlap,
                            at::TensorList after) {
  if (g_enabled.load(std::memory_order_relaxed)) {
    if (auto site = find_site(index)) {
      for (Site* s = site.get(); s; s = s->next.get())
        if (auto y = launch(*s, a, b, std::nullopt, std::nullopt, std::max<int64_t>(overlap, 0))) return *y;
    }
  }
  join_all(a.device());  // the twin runs on the current stream, after everything pending
  static const auto twin = python_twin("cutlass_byoc::wgrad_site_async_py")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, at::TensorList)>();
  return twin.call(a, b, index, overlap, after);
}

}  // namespace

#ifdef CB_SITES_TEST_CPU
TORCH_LIBRARY_IMPL(cutlass_byoc, CPU, m) {
#else
TORCH_LIBRARY_IMPL(cutlass_byoc, CUDA, m) {
#endif
  m.impl("fprop_site", &fprop_site);
  m.impl("dgrad_site", &two_operand_site<kDgradTwin>);
  m.impl("wgrad_site", &two_operand_site<kWgradTwin>);
  m.impl("wgrad_site_async", &wgrad_site_async);
}

// ------------------------------------------------------------------------------------------ the C API (ctypes)
extern "C" {

int64_t cb_sites_abi() { return kSpecAbi; }

}  // extern "C"

namespace {

// A Site from `spec` (copied; its argument block too), or nullptr with `why` set.
std::shared_ptr<Site> make_site(const SiteSpec* spec, const char* name, std::string& why) {
  if (spec == nullptr || spec->abi != kSpecAbi) return why = "SiteSpec ABI mismatch", nullptr;
  if (spec->run == nullptr || spec->args == nullptr) return why = "no cb_run or argument block", nullptr;
  if (spec->args_bytes <= 0 || spec->args_bytes > kMaxArgsBytes) return why = "argument block size out of range", nullptr;
  for (int64_t off : {spec->off_a, spec->off_b, spec->off_d, spec->off_source, spec->off_bias})
    if (off < 0 || off + static_cast<int64_t>(sizeof(void*)) > spec->args_bytes)
      if (!(off == spec->off_bias && spec->bias_len < 0)) return why = "pointer offset outside the argument block", nullptr;
  if (spec->source_dim != -1 && spec->source_dim != 1 && spec->source_dim != 4) return why = "source_dim", nullptr;
  auto site = std::make_shared<Site>();
  site->spec = *spec;
  site->args.fill(0);
  std::memcpy(site->args.data(), spec->args, static_cast<size_t>(spec->args_bytes));
  site->spec.args = nullptr;  // the copy in site->args is the one used
  auto dtype = [](int64_t code) { return static_cast<c10::ScalarType>(code); };
  site->dt_a = dtype(spec->dt_a);
  site->dt_b = dtype(spec->dt_b);
  site->dt_out = dtype(spec->dt_out);
  site->dt_source = dtype(spec->source_dim > 0 ? spec->dt_source : spec->dt_out);
  site->dt_bias = dtype(spec->bias_len >= 0 ? spec->dt_bias : spec->dt_out);
  site->name = name ? name : "";
  return site;
}

// Copy of `site` (its argument block, spec and call count) pointing at `next`: chains are never changed in place.
std::shared_ptr<Site> relink(const Site& site, std::shared_ptr<Site> next) {
  auto copy = std::make_shared<Site>();
  copy->spec = site.spec;
  copy->args = site.args;
  copy->dt_a = site.dt_a, copy->dt_b = site.dt_b, copy->dt_out = site.dt_out;
  copy->dt_source = site.dt_source, copy->dt_bias = site.dt_bias;
  copy->name = site.name;
  copy->calls.store(site.calls.load());
  copy->next = std::move(next);
  return copy;
}

// Site `index` bound to `spec`: replacing what it had, or (`add`) as one more binding tried before the ones it has,
// at most kMaxVariants kept (the oldest dropped). Returns 0, or -1 with `msg` set.
int bind_site(int64_t index, const SiteSpec* spec, const char* name, char* msg, int msg_len, bool add) {
  std::string why;
  if (index < 0) why = "negative site index";
  auto site = why.empty() ? make_site(spec, name, why) : nullptr;
  if (!site) {
    std::snprintf(msg, static_cast<size_t>(msg_len), "%s", why.c_str());
    return -1;
  }
  std::lock_guard<std::mutex> lock(g_mutex);
  if (index >= static_cast<int64_t>(g_sites.size())) g_sites.resize(static_cast<size_t>(index) + 1);
  if (add) {  // the kept bindings, newest first, copied into a new chain (readers may hold the old one)
    std::vector<const Site*> kept;
    for (const Site* s = g_sites[static_cast<size_t>(index)].get(); s && kept.size() + 1 < kMaxVariants;
         s = s->next.get())
      kept.push_back(s);
    std::shared_ptr<Site> chain;
    for (auto it = kept.rbegin(); it != kept.rend(); ++it) chain = relink(**it, std::move(chain));
    site->next = std::move(chain);
  }
  g_sites[static_cast<size_t>(index)] = std::move(site);
  return 0;
}

}  // namespace

extern "C" {

// Bind site `index` to `spec` (copied; its argument block too), replacing what it had. Returns 0, or -1 with `msg`.
int cb_site_set(int64_t index, const SiteSpec* spec, const char* name, char* msg, int msg_len) {
  return bind_site(index, spec, name, msg, msg_len, false);
}

// One more binding of site `index` (a dynamic site's binding at another batch size), tried before the ones it has;
// at most kMaxVariants are kept, the oldest dropped. Returns 0, or -1 with `msg` set.
int cb_site_add(int64_t index, const SiteSpec* spec, const char* name, char* msg, int msg_len) {
  return bind_site(index, spec, name, msg, msg_len, true);
}

// Unbind a site (its calls take the Python twin again).
void cb_site_clear(int64_t index) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (index >= 0 && index < static_cast<int64_t>(g_sites.size())) g_sites[static_cast<size_t>(index)] = nullptr;
}

int64_t cb_site_calls(int64_t index) {
  int64_t n = 0;
  for (auto site = find_site(index); site; site = site->next) n += site->calls.load();
  return n;
}

void cb_sites_reset_calls() {
  std::lock_guard<std::mutex> lock(g_mutex);
  for (auto& head : g_sites)
    for (Site* s = head.get(); s; s = s->next.get()) s->calls.store(0);
}

// 0: every call takes the Python twin (debugging, A/B checks); 1: the fast path runs.
void cb_sites_enable(int on) { g_enabled.store(on != 0); }

// The current stream of CUDA device `device_index` waits for every pending side launch (wgrad_site_async).
void cb_overlap_join(int64_t device_index) {
  if (!kCpu && device_index >= 0 && device_index < kMaxDevices)
    join_all(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index)));
}

// Side launches of device `device_index` not joined yet (tests: 0 after every compiled graph's run).
int64_t cb_overlap_pending(int64_t device_index) {
  SideStream* st = device_index < 0 || device_index >= kMaxDevices
                        ? nullptr : side_state(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index)));
  if (!st) return 0;
  std::lock_guard<std::mutex> lock(st->m);
  return static_cast<int64_t>(st->pending.size());
}

// Host microseconds per call of a bound site's fast path, without the dispatcher and Python in front of it (the
// host-overhead benchmark's split of a call): what = 0 times launch() (the checks, the output and workspace
// allocations, the argument block and cb_run), what = 1 cb_run alone on one prepared argument block. Operands of
// the spec's shapes and dtypes are allocated here (channels_last, the allocator's alignment) on `device_index`
// (-1: the CPU, for the CPU test build). The time runs from the first call to the stream's drain after the last.
// Returns -1 with `msg` set when the site is not bound or a call fails.
double cb_site_time(int64_t index, int64_t device_index, int64_t iters, int what, char* msg, int msg_len) {
  auto fail = [&](const std::string& why) {
    std::snprintf(msg, static_cast<size_t>(msg_len), "%s", why.c_str());
    return -1.0;
  };
  auto site = find_site(index);
  if (!site) return fail("site not bound");
  const SiteSpec& sp = site->spec;
  const at::Device dev = device_index < 0 ? at::Device(at::kCPU)
                                          : at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device_index));
  std::optional<c10::DeviceGuard> guard;
  if (!kCpu) guard.emplace(dev);
  auto operand = [&](const int64_t* shape, int64_t dim, c10::ScalarType dt) {
    auto t = at::empty(c10::IntArrayRef(shape, static_cast<size_t>(dim)), at::TensorOptions().dtype(dt).device(dev));
    return dim == 4 ? t.contiguous(at::MemoryFormat::ChannelsLast) : t;
  };
  at::Tensor a = operand(sp.a_shape, 4, site->dt_a), b = operand(sp.b_shape, 4, site->dt_b);
  std::optional<at::Tensor> source, bias;
  if (sp.source_dim > 0) source = operand(sp.source_shape, sp.source_dim, site->dt_source);
  if (sp.bias_len >= 0) bias = operand(&sp.bias_len, 1, site->dt_bias);
  // (as launch() takes them: the epilogue source, i.e. the residual or else the bias, then the second pointer)
  void* stream = nullptr;
  std::optional<c10::Stream> cstream;
  if (!kCpu) {
    cstream = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(dev);
    stream = cstream->native_handle();
  }
  // cb_run alone: the argument block of one launch, filled once
  std::array<uint8_t, kMaxArgsBytes> args{};
  at::Tensor out, workspace;
  if (what == 1) {
    out = at::empty_strided(c10::IntArrayRef(sp.out_size, 4), c10::IntArrayRef(sp.out_stride, 4),
                            at::TensorOptions().dtype(site->dt_out).device(dev));
    args = args_for(*site, a.const_data_ptr(), b.const_data_ptr(), out.data_ptr(),
                    source ? source->const_data_ptr() : nullptr, bias ? bias->const_data_ptr() : nullptr);
    if (sp.workspace_bytes > 0)
      workspace = at::empty({sp.workspace_bytes}, at::TensorOptions().dtype(at::kByte).device(dev));
  }
  char err[256] = {0};
  auto one = [&]() -> bool {
    if (what == 1)
      return reinterpret_cast<RunFn>(sp.run)(args.data(), sp.workspace_bytes > 0 ? workspace.data_ptr() : nullptr,
                                             sp.workspace_bytes, stream, err, sizeof(err)) == 0;
    return launch(*site, a, b, source, bias).has_value();
  };
  try {
    for (int i = 0; i < 20; ++i)  // warm-up
      if (!one()) return fail(std::string("a call failed or was refused: ") + err);
    if (cstream) cstream->synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i = 0; i < iters; ++i)
      if (!one()) return fail(std::string("a call failed or was refused: ") + err);
    if (cstream) cstream->synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    const double us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    return us / static_cast<double>(std::max<int64_t>(iters, 1));
  } catch (const std::exception& e) {
    return fail(e.what());
  }
}

}  // extern "C"
