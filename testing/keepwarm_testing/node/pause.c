/* The pod sandbox's process (containerd's `sandbox` image): it holds the pod's namespaces open and
 * does nothing else. PID 1 of the sandbox: reaps whatever is reparented to it, exits on SIGTERM or
 * SIGINT. Built statically by images.py into an image FROM scratch, since no image registry holds
 * Kubernetes' own pause image here. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int sig) { (void)sig; _exit(0); }

static void reap(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

int main(void) {
  struct sigaction on_stop = {.sa_handler = stop};
  struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  if (getpid() != 1) {
    return 1; /* meant to be a sandbox's init only */
  }
  sigaction(SIGTERM, &on_stop, NULL);
  sigaction(SIGINT, &on_stop, NULL);
  sigaction(SIGCHLD, &on_child, NULL);
  for (;;) {
    pause();
  }
}
