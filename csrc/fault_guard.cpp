#include "fault_guard.h"

#include <csignal>
#include <mutex>

namespace dcpds {

namespace {

// Initial-exec TLS: allocated with the thread, so the handler never allocates it (a first access
// from a signal handler could otherwise call malloc).
__thread GuardedRead* volatile t_guarded_read __attribute__((tls_model("initial-exec"))) = nullptr;

struct sigaction g_previous_segv;
struct sigaction g_previous_bus;

// Hands a fault that is not a guarded read's to the handler that was there before ours; for the
// default action (or an ignored SIGSEGV, which would loop) it reinstates the default and returns,
// so the faulting access runs again and ends the process as it would have without us.
void forward(int sig, siginfo_t* info, void* context) {
  const struct sigaction& previous = sig == SIGBUS ? g_previous_bus : g_previous_segv;
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(sig, info, context);
    return;
  }
  if ((previous.sa_flags & SA_SIGINFO) == 0 && previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
    return;
  }
  struct sigaction dfl {};
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  sigaction(sig, &dfl, nullptr);
}

void on_fault(int sig, siginfo_t* info, void* context) {
  GuardedRead* g = t_guarded_read;
  const uintptr_t address = reinterpret_cast<uintptr_t>(info->si_addr);
  // si_code > 0: a fault of this thread's own access (a signal sent with kill/raise has none).
  if (g != nullptr && info->si_code > 0 && address >= g->lo && address < g->hi) siglongjmp(g->jump, 1);
  forward(sig, info, context);
}

}  // namespace

GuardedRead* volatile& current_guarded_read() { return t_guarded_read; }

void install_fault_guard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action {};
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(SIGSEGV, &action, &g_previous_segv);
    sigaction(SIGBUS, &action, &g_previous_bus);
  });
}

}  // namespace dcpds
