// Carries a thread's torch profiler state into another thread, as torch's own
// threads (autograd engine, at::launch) carry it with at::ThreadLocalState.
//
// Only the two pieces the profiler lives in are carried: the thread-local
// debug info chain (the profiler's state, PROFILER_STATE) and the
// RecordFunction thread-local callbacks (the profiler's op callbacks).
// at::ThreadLocalState would also carry grad mode, autocast, the dispatch and
// torch-function mode stacks and the saved-tensor hooks: dtape decides those
// for a replica itself, and a profiled run must compute exactly what an
// unprofiled one does.
//
// Plain C functions (no Python headers, no pybind) so that the library
// compiles in seconds and is called through ctypes.
#include <ATen/record_function.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <memory>

namespace {

struct Captured {
  std::shared_ptr<c10::ThreadLocalDebugInfo> debug_info;
  at::RecordFunctionTLS record_function;
};

// Installs a captured state on the current thread; its destructor gives the
// thread back its own state (the RecordFunction callbacks, then the chain).
struct Entered {
  explicit Entered(const Captured& c)
      : debug_info(c.debug_info), previous(at::get_record_function_tls_()) {
    at::set_record_function_tls_(c.record_function);
  }
  ~Entered() {
    at::set_record_function_tls_(previous);
  }
  c10::DebugInfoGuard debug_info;
  at::RecordFunctionTLS previous;
};

} // namespace

extern "C" {

// The calling thread's profiler state; NULL on failure. Free with dtape_thread_state_free.
void* dtape_thread_state_capture() noexcept {
  try {
    return new Captured{c10::ThreadLocalDebugInfo::current(), at::get_record_function_tls_()};
  } catch (...) {
    return nullptr;
  }
}

// Enters `captured` on the calling thread; returns the guard to pass to
// dtape_thread_state_exit on the same thread, NULL on failure.
void* dtape_thread_state_enter(void* captured) noexcept {
  try {
    return new Entered(*static_cast<Captured*>(captured));
  } catch (...) {
    return nullptr;
  }
}

void dtape_thread_state_exit(void* entered) noexcept {
  delete static_cast<Entered*>(entered);
}

void dtape_thread_state_free(void* captured) noexcept {
  delete static_cast<Captured*>(captured);
}

} // extern "C"
