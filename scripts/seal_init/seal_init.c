/* The init of a sealed turn's PID namespace (PID 1): forward every signal it is sent to PID 2 (the
 * target), reap every child, exit with PID 2's status (the target's; 128+N for a signal N).
 * cgturn/_spawn.c embeds the static executable this builds (SEAL_INIT_ELF) and execs it from a memfd in
 * the sandbox's PID 1, once the target (PID 2) has exec'd: a program without libc, so the init costs
 * one small exec, and holds no copy of the caller's memory. Rebuild the array with
 * `python3 scripts/seal_init/build.py` (gcc, x86_64); the same source and compiler give the same
 * bytes, and `build.py --check` compares them with the array.
 *
 * What it takes from tini (src/tini.c) and bubblewrap's init (bubblewrap.c, do_init), and why:
 * - tini's loop: every signal blocked, taken with sigtimedwait, SIGCHLD kept to reap and every other
 *   one sent on to the child with kill(2) (an error ignored: the child may be gone). Popen.pid is this
 *   init, so terminate(), send_signal() and os.kill(p.pid, ...) reach the target through it (the
 *   kernel drops a signal an init has no handler for, pid_namespaces(7), but queues one it blocks:
 *   kernel/signal.c, sig_ignored). tini leaves the synchronous signals (SIGSEGV, ...) unblocked, which
 *   this code cannot raise, and ignores SIGTTIN/SIGTTOU, which only a terminal's writer gets: none is
 *   left out here. bubblewrap's init forwards nothing (its outer process neither).
 * - tini's isolate_child, turned round: this init leaves the caller's process group for one of its own
 *   (setpgid(0, 0)) and the target stays where the caller put it. A terminal's Ctrl-C, or a killpg of
 *   the caller's group, then reaches the target once, directly, not a second time forwarded (many
 *   programs take a second SIGINT or SIGTERM as "stop now"); os.killpg(p.pid, ...) reaches this
 *   group, so the target, once. cgturn's abandon signals every member by host pid but this init.
 * - bubblewrap's exit status: 128+N for a target killed by signal N (propagate_exit_status): an init
 *   cannot die of a signal it sends itself.
 * SIGKILL and SIGSTOP cannot be blocked: SIGKILL ends the init, and the kernel then kills the whole
 * namespace; SIGSTOP stops the init alone. The init keeps no capability: a target that runs as another
 * user (user=) is not its to signal (kill(2): EPERM), so such a signal is dropped. */
typedef unsigned long u64;
static inline long sc4(long n, long a, long b, long c, long d)
{
    long r;
    register long r10 __asm__("r10") = d;
    __asm__ volatile("syscall" : "=a"(r) : "0"(n), "D"(a), "S"(b), "d"(c), "r"(r10) : "rcx", "r11", "memory");
    return r;
}
#define SIGCHLD 17
#define WNOHANG 1
void _start(void)
{
    u64 all = ~0UL;  /* every signal, as the kernel's 8-byte sigset */
    sc4(14 /* rt_sigprocmask */, 2 /* SIG_SETMASK */, (long)&all, 0, 8);
    sc4(109 /* setpgid */, 0, 0, 0, 0);
    long sig = 0;
    for (;;) {
        if (sig > 0 && sig != SIGCHLD)
            sc4(62 /* kill */, 2, sig, 0, 0);
        /* then reap: a SIGCHLD may have come (and gone) before this exec */
        int status;
        long pid;
        while ((pid = sc4(61 /* wait4 */, -1, (long)&status, WNOHANG, 0)) > 0)
            if (pid == 2) {
                int code = (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f);
                sc4(231 /* exit_group */, code, 0, 0, 0);
            }
        sig = sc4(128 /* rt_sigtimedwait */, (long)&all, 0, 0, 8);
    }
}
