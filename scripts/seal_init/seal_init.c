/* The init of a sealed turn's PID namespace (PID 1): reap every child, exit with PID 2's status (the
 * target's; 128+N for a signal N), drop every signal. cgturn/_spawn.c embeds the static executable
 * this builds (SEAL_INIT_ELF) and execs it from a memfd in the sandbox's PID 1, once the target (PID 2)
 * has exec'd: a 560-byte program without libc, so the init costs one small exec, and holds no copy of
 * the caller's memory. Rebuild the array with `python3 scripts/seal_init/build.py` (gcc, x86_64).
 *
 * Every signal stays blocked and is taken and dropped, none forwarded: whatever signals a turn reaches
 * every member by its host pid (abandon, a terminal's process group), the target included, so a
 * forwarded copy would be a second SIGTERM or SIGINT, which many programs take as "stop now". SIGKILL
 * cannot be blocked: it ends the init, and the kernel then kills the whole namespace. */
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
    for (;;) {  /* reap first: a SIGCHLD may have come (and gone) before this exec */
        int status;
        long pid;
        while ((pid = sc4(61 /* wait4 */, -1, (long)&status, WNOHANG, 0)) > 0)
            if (pid == 2) {
                int code = (status & 0x7f) == 0 ? (status >> 8) & 0xff : 128 + (status & 0x7f);
                sc4(231 /* exit_group */, code, 0, 0, 0);
            }
        while (sc4(128 /* rt_sigtimedwait */, (long)&all, 0, 0, 8) != SIGCHLD)
            ;
    }
}
