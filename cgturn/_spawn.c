/* cgturn._spawn: start a child directly in a cgroup, with clone3(CLONE_INTO_CGROUP | CLONE_VFORK |
 * CLONE_VM) (Linux 5.7+), and exec the target there. No migration, no shim, no window: the child is a
 * member of the cgroup from its first instruction.
 *
 * The child shares the parent's memory and runs on its own stack until execve; it runs only
 * async-signal-safe code (the discipline of CPython's _posixsubprocess and glibc's posix_spawn): no
 * Python, no malloc, no locks. Every signal is blocked in the parent across the clone, so no handler of
 * the parent can run in the child; the child resets handled signals to SIG_DFL and restores the
 * caller's mask just before execve. CLONE_VFORK suspends only the calling thread until the child
 * execs or exits, so the parent's memory (argv, envp, the stack buffer) stays valid for the child.
 * The kernel wakes the parent as the exec lets go of the old memory, just before it installs the new
 * (fs/exec.c, exec_mmap: exec_mm_release, then tsk->mm = mm), so for that moment a reader of the
 * child's /proc/PID/cmdline may still get the caller's, under emulation even after spawn() returned:
 * the child touches none of the caller's memory by then.
 *
 * Failures before or at exec are written to a CLOEXEC pipe as "OSError:<hex errno>:<stage>", the
 * format _posixsubprocess uses; an exec that succeeds closes the pipe, so the parent reads EOF. The
 * child also leaves its errno in the parent's memory first (struct child_failure), for the case where
 * its memory cgroup cannot take the pipe's buffer.
 *
 * spawn() reads as its steps: parse the arguments, convert them to the C arrays the child reads,
 * clone (plain, or checked under the directory's lock), read the child's report, release what the
 * call held.
 *
 * Why one file of ~1,350 lines: the child side (async-signal-safe, no Python; the sealed spawn's
 * sandbox and its embedded init are part of it) and the parent side (the checked spawn's lock, record
 * comparison and clone; the pools of stacks and directory fds kept between spawns) share one struct
 * and one calling convention, and the extension is one module to build.
 *
 * Built for the stable ABI (Py_LIMITED_API, 3.11): one wheel serves every CPython from 3.11 on
 * (docs/install.md says why), so only functions of the limited API appear here, never the
 * PyTuple_GET_ITEM-style macros. Its libc symbols are kept to old versions (raw system calls where
 * glibc added a new one: raw_fcntl, thread_sigmask) so the wheel gets a low manylinux tag.
 *
 * Only x86_64 has the clone3 trampoline below (the child must call into C on its new stack, which a
 * libc syscall() wrapper cannot do); elsewhere this file does not build and cgturn uses its shim.
 */
#define PY_SSIZE_T_CLEAN
#ifndef Py_LIMITED_API
#define Py_LIMITED_API 0x030B0000  /* the stable ABI of CPython 3.11+, as setup.py builds it */
#endif
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/xattr.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#if !defined(__x86_64__)
#error "cgturn._spawn: the clone3 trampoline is written for x86_64 only"
#endif
#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif

/* The child's stack: the target's exec loop, a few libc wrappers and the fd loop need far less. */
#define CHILD_STACK_SIZE (256 * 1024)
/* Stacks kept for the next spawns: a fresh mapping costs an mmap, a munmap and the child's page faults
 * on every spawn (about 9 us here, measured against _posixsubprocess.fork_exec). Taken and returned
 * with the GIL held, so the list needs no lock of its own; one per spawn in flight at once. */
#define STACK_POOL_MAX 16
static void *stack_pool[STACK_POOL_MAX];
static int stack_pool_len;

struct clone_args_v2 {  /* struct clone_args up to CLONE_ARGS_SIZE_VER2 (Linux 5.7) */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid,
        set_tid_size, cgroup;
};

/* The child's failure, written into the parent's memory (CLONE_VM) just before its report goes to the
 * pipe: the pipe may not take it. A pipe buffer page is charged to the writer's memory cgroup
 * (pipe_write allocates it with __GFP_ACCOUNT), and a turn, task or root limited to less than one page
 * cannot grow by one, so the write fails with ENOMEM and the child's exit (255) would look like an exec
 * that worked. The parent reads this once the child has exec'd or exited (CLONE_VFORK). */
struct child_failure {
    volatile int err;           /* 0: no failure reported */
    const char *volatile stage;
};

struct child {
    struct child_failure *failure;
    char *const *argv;
    char *const *envp;          /* NULL: the parent's environ */
    char *const *exec_list;     /* candidate paths, tried in order (Popen's PATH search) */
    const char *cwd;
    const int *keep;            /* sorted fds that survive close_fds */
    Py_ssize_t n_keep;
    const int *join;            /* open v1 cgroup.procs files: the child writes "0" (itself) to each */
    Py_ssize_t n_join;
    int close_fds, restore_signals, start_new_session, process_group, umask_value;
    int p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, errpipe_write;
    sigset_t mask;              /* the caller's signal mask, restored before execve */
    const struct seal *seal;    /* NULL: not sealed (see "the seal" below) */
};

/* --- child side: async-signal-safe only ------------------------------------------------------- */

static void write_all(int fd, const char *buf, size_t len)
{
    while (len > 0) {
        ssize_t n = write(fd, buf, len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        buf += n;
        len -= (size_t)n;
    }
}

static void report(const struct child *c, int err, const char *stage)
{
    char buf[64] = "OSError:";
    size_t pos = 8, i;
    char digits[16];
    int n = 0;
    unsigned int value = (unsigned int)err;
    do {
        digits[n++] = "0123456789abcdef"[value & 0xf];
        value >>= 4;
    } while (value && n < (int)sizeof(digits));
    while (n > 0)
        buf[pos++] = digits[--n];
    buf[pos++] = ':';
    for (i = 0; stage[i] && pos < sizeof(buf); i++)
        buf[pos++] = stage[i];
    c->failure->stage = stage;
    c->failure->err = err ? err : EIO;  /* a failure always reads as one, even without an errno */
    write_all(c->errpipe_write, buf, pos);
}

/* fcntl(2) as the raw system call, for the manylinux tag of the wheel: with _FILE_OFFSET_BITS=64
 * (pyconfig.h sets it) glibc 2.28+ headers redirect fcntl to fcntl64@GLIBC_2.28, so the libc
 * wrapper would make the extension need glibc 2.28. The commands used here (F_GETFD, F_SETFD,
 * F_DUPFD_CLOEXEC) take an int and mean the same to every kernel cgturn runs on; syscall() is
 * async-signal-safe (it only sets errno), so the child may call this too. */
static int raw_fcntl(int fd, int cmd, int arg)
{
    return (int)syscall(SYS_fcntl, fd, cmd, arg);
}

static int set_inheritable(int fd)
{
    int flags = raw_fcntl(fd, F_GETFD, 0);
    if (flags < 0)
        return -1;
    if (flags & FD_CLOEXEC)
        return raw_fcntl(fd, F_SETFD, flags & ~FD_CLOEXEC);
    return 0;
}

/* The bound of the close loop below: RLIMIT_NOFILE's soft limit (what sysconf(_SC_OPEN_MAX) gives),
 * read with the raw system call, which is async-signal-safe; asked only when close_range(2) fails, so
 * a spawn on 5.9+ makes no such call. */
static int open_max(void)
{
    struct rlimit rl;
    if (syscall(SYS_getrlimit, RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur > 0 && rl.rlim_cur < INT_MAX)
        return (int)rl.rlim_cur;
    return 65536;
}

static void close_range_or_loop(int low, int high)
{
    if (low > high)
        return;
    if (syscall(SYS_close_range, (unsigned)low, (unsigned)high, 0) == 0)
        return;
    /* close_range(2) is 5.9+; clone3 with CLONE_INTO_CGROUP (5.7+) may run without it */
    int max_fd = open_max();
    if (high > max_fd)
        high = max_fd;
    for (int fd = low; fd <= high; fd++)
        close(fd);
}

static void close_all_but(const struct child *c)
{
    int low = 3;
    for (Py_ssize_t i = 0; i < c->n_keep; i++) {
        int keep = c->keep[i];
        if (keep < low)
            continue;
        close_range_or_loop(low, keep - 1);
        low = keep + 1;
    }
    close_range_or_loop(low, INT_MAX);
}

static void reset_signal_handlers(void)
{
    struct sigaction sa;
    for (int sig = 1; sig < _NSIG; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP)
            continue;
        if (sigaction(sig, NULL, &sa) != 0)
            continue;  /* glibc's reserved signals (32, 33) */
        if (sa.sa_handler == SIG_IGN || sa.sa_handler == SIG_DFL)
            continue;
        sa.sa_handler = SIG_DFL;
        sa.sa_flags = 0;
        sigemptyset(&sa.sa_mask);
        sigaction(sig, &sa, NULL);
    }
}

/* --- the seal (issue 21): a sealed turn's sandbox, built by the child itself ---------------------
 *
 * What bubblewrap builds for a sealed spawn (backends/seal.py), without exec'ing it: the child is
 * cloned into the turn's cgroup and into new PID, mount and IPC namespaces, so it is PID 1 there. It
 * makes its mounts private (MS_SLAVE, as bwrap), clones the paths it binds back while they are still
 * the host's (open_tree), makes the whole tree read-only, nosuid and nodev in ONE call (mount_setattr
 * AT_RECURSIVE, Linux 5.12: bwrap remounts every submount one by one), mounts a fresh /proc with its
 * host-state files bound read-only, a minimal /dev (tmpfs, the six nodes bwrap keeps, a new devpts),
 * private /tmp and /run, moves the binds in, enters the turn's network namespace and a cgroup
 * namespace rooted at the turn, cuts the bounding set to the kept capabilities and sets no_new_privs
 * and the syscall filter (for itself and the target alike), and starts the target (PID 2, clone(2)
 * with CLONE_VFORK), which sets its capability sets and execs; then PID 1 drops every capability but
 * CAP_KILL and execs the namespace's init (SEAL_INIT_ELF). Like the unsealed child, it runs in the
 * caller's memory (CLONE_VM | CLONE_VFORK) until that exec.
 * Only raw system calls and async-signal-safe libc calls, as the rest of the child. */
#define SEAL_MAX_BINDS 32
#define SEAL_MAX_PROC_RO 8
#define SEAL_BIND_WRITABLE 1
#define SEAL_BIND_DIR 2
struct seal {
    const char *bind_path[SEAL_MAX_BINDS];  /* bound in order, each onto itself */
    int bind_flags[SEAL_MAX_BINDS];
    int n_binds;
    const char *proc_ro[SEAL_MAX_PROC_RO];  /* bound read-only in the new /proc; the first must exist */
    int n_proc_ro;
    const char *cwd;
    const void *filter;                     /* struct sock_filter records */
    unsigned short filter_len;
    uint64_t caps;                          /* kept capabilities, a bit per number */
    int last_cap;
    int netns_fd;                           /* -1: the caller's network */
    void *target_stack;                     /* the target's until it execs (CHILD_STACK_SIZE) */
    int init_fd;                            /* a memfd holding SEAL_INIT_ELF */
};
static int child_exec(void *arg);
static int seal_bound(const struct seal *s, uint64_t drop);
static int seal_confine(const struct seal *s);
static int seal_caps(uint64_t caps);
static long clone3_call(struct clone_args_v2 *args, int (*fn)(void *), void *arg);

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#define SEAL_OPEN_TREE_CLONE 1
#define SEAL_AT_RECURSIVE 0x8000
#define SEAL_AT_EMPTY_PATH 0x1000
#define SEAL_MOVE_MOUNT_F_EMPTY_PATH 0x4
#define SEAL_ATTR_RDONLY 0x1
#define SEAL_ATTR_NOSUID 0x2
#define SEAL_ATTR_NODEV 0x4
struct seal_mount_attr { uint64_t attr_set, attr_clr, propagation, userns_fd; };
/* What bwrap's --dev keeps of the host's /dev (bubblewrap.c, devnodes[]), by their fixed numbers
 * (Documentation/admin-guide/devices.txt): made in the sandbox's own /dev, as Docker and runc make a
 * container's, rather than bound one by one from the host's (bwrap must bind: inside a user namespace
 * mknod is refused). Four system calls fewer per node. */
static const struct { const char *path; unsigned int major, minor; } seal_dev_nodes[] = {
    {"/dev/null", 1, 3}, {"/dev/zero", 1, 5}, {"/dev/full", 1, 7},
    {"/dev/random", 1, 8}, {"/dev/urandom", 1, 9}, {"/dev/tty", 5, 0},
};
#define SEAL_N_DEV (int)(sizeof(seal_dev_nodes) / sizeof(seal_dev_nodes[0]))

static int seal_open_tree(const char *path, int recursive)
{
    return (int)syscall(SYS_open_tree, AT_FDCWD, path,
                        SEAL_OPEN_TREE_CLONE | O_CLOEXEC | (recursive ? SEAL_AT_RECURSIVE : 0));
}

static int seal_setattr(int dfd, const char *path, int flags, uint64_t set, uint64_t clr)
{
    struct seal_mount_attr attr = {set, clr, 0, 0};
    return (int)syscall(SYS_mount_setattr, dfd, path, flags, &attr, sizeof attr);
}

static int seal_move(int fd, const char *to)
{
    return (int)syscall(SYS_move_mount, fd, "", AT_FDCWD, to, SEAL_MOVE_MOUNT_F_EMPTY_PATH);
}

/* mkdir -p of `path` (a file at the end unless `dir`), for a mount point inside a new tmpfs; what
 * exists already (the read-only host's directories) is left as it is. (memmove, not memcpy:
 * glibc's memcpy is a GLIBC_2.14 symbol, which would lift the wheel's manylinux tag.) */
static void seal_mountpoint(const char *path, int dir)
{
    char buf[4096];
    size_t len = strlen(path);
    if (len >= sizeof buf)
        return;
    memmove(buf, path, len + 1);
    for (size_t i = 1; i < len; i++)
        if (buf[i] == '/') {
            buf[i] = '\0';
            mkdir(buf, 0755);
            buf[i] = '/';
        }
    if (dir) {
        mkdir(buf, 0755);
    } else {
        int fd = open(buf, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
        if (fd >= 0)
            close(fd);
    }
}

/* The namespace's init, exec'd by PID 1 once the target has exec'd: scripts/seal_init/seal_init.c
 * built static without libc (scripts/seal_init/build.py prints this array). It forwards every signal
 * but SIGCHLD to PID 2 (as tini does), in a process group of its own (so a terminal's signal reaches
 * the target once, directly), reaps every child and exits with PID 2's status (128+N for a signal N,
 * as bwrap's init: an init cannot die of a signal it sends itself); the source says why. Exec'd from
 * a sealed memfd made once per process (seal_init_memfd), so it needs no file on disk and holds no
 * copy of the caller's memory. */
static const unsigned char SEAL_INIT_ELF[] = {
    0x7f, 0x45, 0x4c, 0x46, 0x02, 0x01, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x02, 0x00, 0x3e, 0x00, 0x01, 0x00, 0x00, 0x00, 0xb0, 0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xa8, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x40, 0x00, 0x38, 0x00, 0x02, 0x00, 0x40, 0x00, 0x03, 0x00, 0x02, 0x00,
    0x01, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00, 0xb0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0xb0, 0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00, 0xb0, 0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00,
    0xe6, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe6, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x51, 0xe5, 0x74, 0x64, 0x06, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x41, 0x57, 0x41, 0xba, 0x08, 0x00, 0x00, 0x00, 0x31, 0xd2, 0xbf, 0x02, 0x00, 0x00, 0x00, 0x41,
    0x56, 0x41, 0x55, 0x41, 0x54, 0x55, 0x53, 0x48, 0xc7, 0x44, 0x24, 0xf8, 0xff, 0xff, 0xff, 0xff,
    0x48, 0x8d, 0x44, 0x24, 0xf8, 0x48, 0x89, 0x44, 0x24, 0xe8, 0xb8, 0x0e, 0x00, 0x00, 0x00, 0x48,
    0x8b, 0x74, 0x24, 0xe8, 0x0f, 0x05, 0x45, 0x31, 0xd2, 0xb8, 0x6d, 0x00, 0x00, 0x00, 0x48, 0x89,
    0xd7, 0x48, 0x89, 0xd6, 0x0f, 0x05, 0x41, 0xbe, 0x3e, 0x00, 0x00, 0x00, 0x41, 0xbc, 0x02, 0x00,
    0x00, 0x00, 0x4c, 0x8d, 0x4c, 0x24, 0xf4, 0x41, 0xbf, 0x3d, 0x00, 0x00, 0x00, 0x48, 0x83, 0xcb,
    0xff, 0xbd, 0x01, 0x00, 0x00, 0x00, 0x41, 0xbd, 0xe7, 0x00, 0x00, 0x00, 0x41, 0xb8, 0x80, 0x00,
    0x00, 0x00, 0x48, 0x85, 0xf6, 0x7e, 0x13, 0x48, 0x83, 0xfe, 0x11, 0x74, 0x0d, 0x45, 0x31, 0xd2,
    0x4c, 0x89, 0xf0, 0x31, 0xd2, 0x4c, 0x89, 0xe7, 0xeb, 0x3e, 0x45, 0x31, 0xd2, 0x4c, 0x89, 0xf8,
    0x48, 0x89, 0xdf, 0x4c, 0x89, 0xce, 0x48, 0x89, 0xea, 0x0f, 0x05, 0x48, 0x85, 0xc0, 0x7e, 0x2c,
    0x48, 0x83, 0xf8, 0x02, 0x75, 0xe4, 0x8b, 0x44, 0x24, 0xf4, 0x89, 0xc2, 0x83, 0xe2, 0x7f, 0x8d,
    0xba, 0x80, 0x00, 0x00, 0x00, 0x75, 0x03, 0x0f, 0xb6, 0xfc, 0x31, 0xd2, 0x48, 0x63, 0xff, 0x45,
    0x31, 0xd2, 0x4c, 0x89, 0xe8, 0x48, 0x89, 0xd6, 0x0f, 0x05, 0xeb, 0xbe, 0x31, 0xd2, 0x48, 0x8b,
    0x7c, 0x24, 0xe8, 0x41, 0xba, 0x08, 0x00, 0x00, 0x00, 0x4c, 0x89, 0xc0, 0x48, 0x89, 0xd6, 0x0f,
    0x05, 0x48, 0x89, 0xc6, 0xeb, 0x8c, 0x00, 0x2e, 0x73, 0x68, 0x73, 0x74, 0x72, 0x74, 0x61, 0x62,
    0x00, 0x2e, 0x74, 0x65, 0x78, 0x74, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x0b, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,
    0x06, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xb0, 0x00, 0x40, 0x00, 0x00, 0x00, 0x00, 0x00,
    0xb0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0xe6, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x96, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x11, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
};

#define SEAL_FAIL(stage) do { report(c, errno, stage); goto fail; } while (0)

/* The init's one capability, CAP_KILL: it forwards what it is sent to its target, which a user=
 * target (another uid) would refuse it otherwise (kill(2): EPERM). Its reach is its PID namespace,
 * where it signals only PID 2; the target cannot borrow it (ptrace needs the init's permitted set
 * to be a subset of the tracer's, and a root target has no CAP_KILL; a user= target another uid). */
#define SEAL_INIT_CAPS (1ULL << 5)

/* In PID 1 of the new namespaces: the mounts, the network, the cgroup namespace, then the target
 * (child_exec, PID 2), then the init's loop. Returns -1 after a report; else never. */
static int seal_enter(const struct child *c)
{
    const struct seal *s = c->seal;
    int bind_fd[SEAL_MAX_BINDS];
    int i;
    for (i = 0; i < SEAL_MAX_BINDS; i++)
        bind_fd[i] = -1;
    if (mount(NULL, "/", NULL, MS_REC | MS_SLAVE, NULL) != 0)  /* nothing of ours reaches the host */
        SEAL_FAIL("noexec");
    /* taken from the host's tree before it is read-only (and before /tmp and /run are covered) */
    for (i = 0; i < s->n_binds; i++) {
        if ((bind_fd[i] = seal_open_tree(s->bind_path[i], 1)) < 0)
            SEAL_FAIL("noexec");
        uint64_t set = SEAL_ATTR_NOSUID | SEAL_ATTR_NODEV;
        if (!(s->bind_flags[i] & SEAL_BIND_WRITABLE))
            set |= SEAL_ATTR_RDONLY;
        if (seal_setattr(bind_fd[i], "", SEAL_AT_EMPTY_PATH | SEAL_AT_RECURSIVE, set,
                         s->bind_flags[i] & SEAL_BIND_WRITABLE ? SEAL_ATTR_RDONLY : 0) != 0)
            SEAL_FAIL("noexec");
    }
    /* the whole tree, every submount (sysfs, the cgroup mounts, ...), in one call */
    if (seal_setattr(AT_FDCWD, "/", SEAL_AT_RECURSIVE, SEAL_ATTR_RDONLY | SEAL_ATTR_NOSUID | SEAL_ATTR_NODEV, 0) != 0)
        SEAL_FAIL("noexec");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        SEAL_FAIL("noexec");
    for (i = 0; i < s->n_proc_ro; i++) {
        int fd = seal_open_tree(s->proc_ro[i], 1);
        if (fd < 0 && i > 0 && errno == ENOENT)
            continue;  /* a kernel without it */
        if (fd < 0)
            SEAL_FAIL("noexec");
        int bad = seal_setattr(fd, "", SEAL_AT_EMPTY_PATH | SEAL_AT_RECURSIVE,
                               SEAL_ATTR_RDONLY | SEAL_ATTR_NOSUID | SEAL_ATTR_NODEV, 0) != 0
                  || seal_move(fd, s->proc_ro[i]) != 0;
        int saved = errno;
        close(fd);
        errno = saved;
        if (bad)
            SEAL_FAIL("noexec");
    }
    /* Not nodev, as a container's /dev: its nodes are the only devices the sandbox reaches (every
     * other mount is nodev, and the target has no CAP_MKNOD to make one). The nodes are 0666 whatever
     * the caller's umask, as the host's are. */
    if (mount("tmpfs", "/dev", "tmpfs", MS_NOSUID, "mode=0755") != 0)
        SEAL_FAIL("noexec");
    mode_t umask_before = umask(0);
    for (i = 0; i < SEAL_N_DEV; i++)
        if (syscall(SYS_mknodat, AT_FDCWD, seal_dev_nodes[i].path, S_IFCHR | 0666,  /* mknod: GLIBC_2.33 */
                    makedev(seal_dev_nodes[i].major, seal_dev_nodes[i].minor)) != 0)
            SEAL_FAIL("noexec");
    umask(umask_before);
    if (mkdir("/dev/shm", 01777) != 0 || mkdir("/dev/pts", 0755) != 0
        || mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=620") != 0
        || symlink("pts/ptmx", "/dev/ptmx") != 0 || symlink("/proc/self/fd", "/dev/fd") != 0
        || symlink("/proc/self/fd/0", "/dev/stdin") != 0 || symlink("/proc/self/fd/1", "/dev/stdout") != 0
        || symlink("/proc/self/fd/2", "/dev/stderr") != 0)
        SEAL_FAIL("noexec");
    /* /tmp as a host's own is (sticky, everyone's), so a user= target can write it; /run stays root's */
    if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777") != 0
        || mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755") != 0)
        SEAL_FAIL("noexec");
    for (i = 0; i < s->n_binds; i++) {
        seal_mountpoint(s->bind_path[i], s->bind_flags[i] & SEAL_BIND_DIR);
        if (seal_move(bind_fd[i], s->bind_path[i]) != 0)
            SEAL_FAIL("noexec");
    }
    if (s->cwd && chdir(s->cwd) != 0)  /* onto the binds: the old working directory is below them */
        SEAL_FAIL("noexec:chdir");
    if (s->netns_fd >= 0 && syscall(SYS_setns, s->netns_fd, CLONE_NEWNET) != 0)
        SEAL_FAIL("noexec");
    if (unshare(CLONE_NEWCGROUP) != 0)  /* rooted at the turn: the child is in it by now */
        SEAL_FAIL("noexec");
    for (i = 0; i < SEAL_MAX_BINDS; i++)
        if (bind_fd[i] >= 0)
            close(bind_fd[i]);
    /* SIGCHLD at its default (not ignored: the kernel would reap for the init), set before the target
     * exists: setting it discards a pending SIGCHLD (sigaction(2)). */
    struct sigaction dfl;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigaction(SIGCHLD, &dfl, NULL);
    /* What the target keeps and this process gives up alike is set here, once, for both: the bounding
     * set cut to the kept capabilities, no_new_privs and the filter, all of which a child inherits
     * (seccomp(2), capabilities(7)). The target then sets only its capability sets. Each bounding-set
     * drop is a credentials commit and a filter costs its compilation, so this halves the sealed
     * spawn's privilege work. CAP_KILL stays for the init (the target drops it from its own bounding
     * set). This process's own capabilities stay effective until after the target. */
    if (seal_bound(s, ~(s->caps | SEAL_INIT_CAPS)) != 0 || seal_confine(s) != 0)
        SEAL_FAIL("noexec");
    /* The target, PID 2, shares this memory (the caller's) until it execs, as this child does. clone(2),
     * not clone3: the filter refuses clone3 (its flags sit where a filter cannot read them). */
    if (clone(child_exec, (char *)s->target_stack + CHILD_STACK_SIZE, CLONE_VM | CLONE_VFORK | SIGCHLD,
              (void *)c) < 0)
        SEAL_FAIL("noexec");
    /* Then this child becomes the init: nothing kept but CAP_KILL (SEAL_INIT_CAPS), no fd but the
     * init's own, the no_new_privs and filter it already has; the exec releases the caller. */
    if (seal_bound(s, s->caps & ~SEAL_INIT_CAPS) != 0 || seal_caps(SEAL_INIT_CAPS) != 0)
        SEAL_FAIL("noexec");
    /* every fd but the init's and the report pipe (both close-on-exec: the exec closes them) */
    int low = c->errpipe_write < s->init_fd ? c->errpipe_write : s->init_fd;
    int high = c->errpipe_write < s->init_fd ? s->init_fd : c->errpipe_write;
    close_range_or_loop(0, low - 1);
    close_range_or_loop(low + 1, high - 1);
    close_range_or_loop(high + 1, INT_MAX);
    static char *const init_argv[] = {"cgturn-init", NULL}, *const init_envp[] = {NULL};
    syscall(SYS_execveat, s->init_fd, "", init_argv, init_envp, SEAL_AT_EMPTY_PATH);
    SEAL_FAIL("noexec");  /* and the target's namespace dies with this process */
fail:
    return -1;
}

/* The capabilities of `drop` (a bit per number) out of the bounding set: none of them can come back,
 * by an exec as root or a file's capabilities. */
static int seal_bound(const struct seal *s, uint64_t drop)
{
    for (int cap = 0; cap <= s->last_cap && cap < 64; cap++)
        if (((drop >> cap) & 1) && syscall(SYS_prctl, PR_CAPBSET_DROP, cap, 0, 0, 0) != 0)
            return -1;
    return 0;
}

/* no_new_privs and the filter (backends/seal_filter.py), for this process and all it starts. */
static int seal_confine(const struct seal *s)
{
    if (syscall(SYS_prctl, PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        return -1;
    struct { unsigned short len; const void *filter; } program = {s->filter_len, s->filter};
    return syscall(SYS_prctl, PR_SET_SECCOMP, 2 /* SECCOMP_MODE_FILTER */, &program, 0, 0) != 0 ? -1 : 0;
}

/* The permitted, effective, inheritable and ambient sets made exactly `caps`: the target's just before
 * it execs (the kept set), the init's (none). */
static int seal_caps(uint64_t caps)
{
    struct { uint32_t version; int pid; } header = {0x20080522, 0};  /* _LINUX_CAPABILITY_VERSION_3 */
    uint32_t lo = (uint32_t)caps, hi = (uint32_t)(caps >> 32);
    struct { uint32_t effective, permitted, inheritable; } data[2] = {{lo, lo, lo}, {hi, hi, hi}};
    if (syscall(SYS_capset, &header, data) != 0)
        return -1;
    /* as bwrap: the kept set is ambient too, so a non-root program exec'd by root keeps it */
    if (syscall(SYS_prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0)
        return -1;
    for (int cap = 0; cap < 64; cap++)
        if (((caps >> cap) & 1) && syscall(SYS_prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_RAISE, cap, 0, 0) != 0)
            return -1;
    return 0;
}

#define FAIL(stage) do { report(c, errno, stage); return 255; } while (0)

static int child_main(void *arg)
{
    const struct child *c = arg;

    reset_signal_handlers();  /* all signals stay blocked until execve */
    for (Py_ssize_t i = 0; i < c->n_join; i++)  /* v1 hierarchies: before anything runs */
        if (write(c->join[i], "0", 1) != 1)
            FAIL("noexec:cgroup");
    if (c->seal) {
        seal_enter(c);  /* returns only after a report: the target runs child_exec */
        return 255;
    }
    return child_exec(arg);
}

/* The rest of the child, up to execve: the caller's child, or a sealed spawn's target. */
static int child_exec(void *arg)
{
    const struct child *c = arg;
    int p2cread = c->p2cread, c2pwrite = c->c2pwrite, errwrite = c->errwrite;

    if (c->seal && c->seal->netns_fd >= 0)
        close(c->seal->netns_fd);  /* entered by PID 1 already */
    /* As _posixsubprocess: the parent's pipe ends go; the standard fds are dup2'd from what Popen
     * prepared, never clobbering one another. */
    if (c->p2cwrite != -1 && close(c->p2cwrite) != 0) FAIL("noexec");
    if (c->c2pread != -1 && close(c->c2pread) != 0) FAIL("noexec");
    if (c->errread != -1 && close(c->errread) != 0) FAIL("noexec");
    for (Py_ssize_t i = 0; i < c->n_keep; i++)
        if (c->keep[i] != c->errpipe_write && set_inheritable(c->keep[i]) != 0)
            FAIL("noexec");
    if (c2pwrite == 0 && (c2pwrite = dup(c2pwrite)) < 0) FAIL("noexec");
    while (errwrite == 0 || errwrite == 1)
        if ((errwrite = dup(errwrite)) < 0) FAIL("noexec");
    if (p2cread == 0) {
        if (set_inheritable(0) != 0) FAIL("noexec");
    } else if (p2cread != -1 && dup2(p2cread, 0) < 0) FAIL("noexec");
    if (c2pwrite == 1) {
        if (set_inheritable(1) != 0) FAIL("noexec");
    } else if (c2pwrite != -1 && dup2(c2pwrite, 1) < 0) FAIL("noexec");
    if (errwrite == 2) {
        if (set_inheritable(2) != 0) FAIL("noexec");
    } else if (errwrite != -1 && dup2(errwrite, 2) < 0) FAIL("noexec");

    if (c->cwd && chdir(c->cwd) != 0) FAIL("noexec:chdir");
    if (c->umask_value >= 0)
        umask((mode_t)c->umask_value);
    if (c->restore_signals) {  /* what Python ignores at startup (_Py_RestoreSignals) */
        signal(SIGPIPE, SIG_DFL);
        signal(SIGXFSZ, SIG_DFL);
    }
    if (c->start_new_session && setsid() < 0) FAIL("noexec");
    if (c->process_group >= 0 && setpgid(0, c->process_group) != 0) FAIL("noexec");
    if (c->close_fds)
        close_all_but(c);
    /* the rest of the bounding set, no_new_privs and the filter came from PID 1 */
    if (c->seal && (seal_bound(c->seal, SEAL_INIT_CAPS & ~c->seal->caps) != 0 || seal_caps(c->seal->caps) != 0))
        FAIL("noexec");
    sigprocmask(SIG_SETMASK, &c->mask, NULL);

    /* Popen's PATH search (os._execvpe): the first error that is not "not here" wins. */
    int saved = 0;
    for (Py_ssize_t i = 0; c->exec_list[i] != NULL; i++) {
        if (c->envp)
            execve(c->exec_list[i], c->argv, c->envp);
        else
            execv(c->exec_list[i], c->argv);
        if (errno != ENOENT && errno != ENOTDIR && saved == 0)
            saved = errno;
    }
    if (saved)
        errno = saved;
    report(c, errno, "");
    return 255;
}

/* clone3 with the child starting in child_main(arg) on its own stack; returns the pid, or -errno.
 * Registers survive `syscall` except rax, rcx and r11: the child finds fn and arg in r9 and r8, its
 * stack pointer at stack + stack_size (kernel/fork.c, clone3_stack_valid), and never returns here. */
static long clone3_call(struct clone_args_v2 *args, int (*fn)(void *), void *arg)
{
    long ret;
    register void *r8 __asm__("r8") = arg;
    register int (*r9)(void *) __asm__("r9") = fn;
    __asm__ volatile(
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 1f\n\t"
        "xor %%ebp, %%ebp\n\t"
        "mov %%r8, %%rdi\n\t"
        "call *%%r9\n\t"
        "mov %%eax, %%edi\n\t"
        "mov $231, %%eax\n\t"  /* exit_group */
        "syscall\n\t"
        "hlt\n"
        "1:\n\t"
        : "=a"(ret)
        : "0"((long)SYS_clone3), "D"(args), "S"(sizeof(*args)), "r"(r8), "r"(r9)
        : "rcx", "r11", "memory");
    return ret;
}

/* --- parent side ------------------------------------------------------------------------------ */

/* Directory fds holding a shared flock while a checked spawn is in flight (see spawn_checked). A
 * process forked meanwhile by another thread would share the lock through its copy of the fd (flock
 * locks belong to the open file) and hold off every exclusive locker for as long as it lives: the
 * fork's child closes its copies at once (closing, not unlocking, which would release ours too).
 * Changed with the GIL held; os.fork holds it too, so the child sees a consistent list. */
#define INFLIGHT_MAX 1024
static int inflight[INFLIGHT_MAX];
static int inflight_len;

static void close_inflight_in_child(void)
{
    for (int i = 0; i < inflight_len; i++)
        close(inflight[i]);
    inflight_len = 0;
}

static int inflight_add(int fd)
{
    if (inflight_len == INFLIGHT_MAX)
        return -1;
    inflight[inflight_len++] = fd;
    return 0;
}

static void inflight_remove(int fd)
{
    for (int i = 0; i < inflight_len; i++)
        if (inflight[i] == fd) {
            inflight[i] = inflight[--inflight_len];
            return;
        }
}

/* A checked spawn's target: clone into the directory `path` only if, under a shared flock on it,
 * its xattr `key` still holds exactly `expected`. */
struct checked {
    const char *path, *key, *expected;
    Py_ssize_t expected_len;
    char *buf;  /* expected_len + 1 bytes: a longer value reads as a change (ERANGE) */
};

/* Directory fds of recent checked spawns, for the next spawn into the same path (an open of a
 * cgroupfs path and its close cost more than the rest of the check). Each is used by one spawn at a
 * time (a flock belongs to the open file: two spawns sharing one would unlock each other), so a
 * path may have several. Changed with the GIL held. A kept fd pins its cgroup in the kernel after
 * an rmdir (a "dying" cgroup) until it is evicted, so there are few. */
#define DIR_POOL_MAX 16
static struct {
    PyObject *path;  /* bytes */
    int fd;
} dir_pool[DIR_POOL_MAX];
static int dir_pool_len;

static int dir_pool_take(PyObject *path)
{
    for (int i = dir_pool_len - 1; i >= 0; i--) {
        PyObject *p = dir_pool[i].path;
        if (PyBytes_Size(p) == PyBytes_Size(path)
            && memcmp(PyBytes_AsString(p), PyBytes_AsString(path), (size_t)PyBytes_Size(p)) == 0) {
            int fd = dir_pool[i].fd;
            Py_DECREF(p);
            memmove(&dir_pool[i], &dir_pool[i + 1], sizeof(dir_pool[0]) * (size_t)(dir_pool_len - i - 1));
            dir_pool_len--;
            return fd;
        }
    }
    return -1;
}

static void dir_pool_give(PyObject *path, int fd)
{
    if (dir_pool_len == DIR_POOL_MAX) {  /* the oldest goes */
        close(dir_pool[0].fd);
        Py_DECREF(dir_pool[0].path);
        memmove(&dir_pool[0], &dir_pool[1], sizeof(dir_pool[0]) * (DIR_POOL_MAX - 1));
        dir_pool_len--;
    }
    dir_pool[dir_pool_len].path = Py_NewRef(path);
    dir_pool[dir_pool_len].fd = fd;
    dir_pool_len++;
}

/* pthread_sigmask(3) as the raw rt_sigprocmask(2), for the manylinux tag of the wheel: glibc 2.32
 * moved pthread_sigmask from libpthread into libc under a new symbol version (GLIBC_2.32), which the
 * libc wrapper would make the extension need. The system call sets the calling thread's mask, as
 * pthread_sigmask does; what glibc's wrapper adds is refusing to block its internal signals
 * (SIGCANCEL, SIGSETXID), and glibc's sigfillset already leaves those out of the set blocked here.
 * The kernel's sigset is _NSIG / 8 bytes (8 on x86_64), a prefix of glibc's sigset_t. */
static void thread_sigmask(const sigset_t *set, sigset_t *old)
{
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, set, old, (size_t)(_NSIG / 8));
}

/* The clone, every signal blocked across it (see the top of this file); the pid, or -errno. */
static long clone_child(struct clone_args_v2 *cl, struct child *c)
{
    sigset_t all;
    sigfillset(&all);
    thread_sigmask(&all, &c->mask);
    long pid = clone3_call(cl, child_main, c);
    thread_sigmask(&c->mask, NULL);
    return pid;
}

#define CHANGED (-(long)INT_MAX - 1)
/* The shared lock stayed held (exclusively) for all of LOCK_WAIT_NS: nothing started. */
#define LOCK_TIMEOUT (-(long)INT_MAX - 3)
/* How long a checked spawn waits for its shared lock: dirlock.LOCK_WAIT's 2 s, the bound of every
 * lock wait in cgturn. An exclusive holder is a state change (microseconds), or a holder stopped or
 * wedged, or a process of the same user (issue 22), which must not hold a spawn for ever. */
#define LOCK_WAIT_NS 2000000000LL
#define LOCK_POLL_NS 1000000L

/* The raw system call, not glibc's clock_gettime: that symbol is GLIBC_2.17 and would lift the wheel's
 * manylinux tag above 2_12 (docs/install.md). It is read only while a lock is contended. */
static long long monotonic_ns(void)
{
    struct timespec t;
    syscall(SYS_clock_gettime, CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* flock(LOCK_SH) on `fd` within LOCK_WAIT_NS: LOCK_NB polled every LOCK_POLL_NS (flock has no timed
 * form; a shared request waits only while an exclusive lock is held, which is short). 0, -errno,
 * or LOCK_TIMEOUT. The clock is first read on contention, so an uncontended spawn pays no call. */
static long flock_shared_within(int fd)
{
    long long deadline = 0;
    struct timespec pause = {0, LOCK_POLL_NS};
    for (;;) {
        if (flock(fd, LOCK_SH | LOCK_NB) == 0)
            return 0;
        if (errno != EWOULDBLOCK && errno != EINTR)
            return -errno;
        long long now = monotonic_ns();
        if (deadline == 0)
            deadline = now + LOCK_WAIT_NS;
        else if (now >= deadline)
            return LOCK_TIMEOUT;
        nanosleep(&pause, NULL);
    }
}

/* Under a shared flock on `fd`, clone into it if its xattr still holds chk->expected; the pid,
 * CHANGED (nothing started), or -errno. The lock is held until the child has exec'd (CLONE_VFORK)
 * and released before returning. No GIL: system calls only. */
static long checked_clone(int fd, const struct checked *chk, struct clone_args_v2 *cl, struct child *c)
{
    long r = flock_shared_within(fd);
    if (r != 0)
        return r;
    long pid = CHANGED;
    ssize_t n = fgetxattr(fd, chk->key, chk->buf, (size_t)chk->expected_len + 1);
    if (n == chk->expected_len && memcmp(chk->buf, chk->expected, (size_t)n) == 0)
        pid = clone_child(cl, c);
    flock(fd, LOCK_UN);
    return pid;
}

/* The child's report pipe, both ends CLOEXEC and clear of the standard fds the child arranges. */
static int errpipe(int fds[2])
{
    if (pipe2(fds, O_CLOEXEC) != 0)
        return -1;
    for (int i = 0; i < 2; i++) {
        if (fds[i] >= 3)
            continue;
        int moved = raw_fcntl(fds[i], F_DUPFD_CLOEXEC, 3);
        close(fds[i]);
        fds[i] = moved;
    }
    if (fds[0] < 0 || fds[1] < 0) {
        int saved = errno;
        for (int i = 0; i < 2; i++)
            if (fds[i] >= 0)
                close(fds[i]);
        fds[0] = fds[1] = -1;
        errno = saved;
        return -1;
    }
    return 0;
}

/* Insert `fd` into the sorted `keep` array of *n ints (room for one more: int_array's). */
static void keep_insert(int *keep, Py_ssize_t *n, int fd)
{
    Py_ssize_t i = *n;
    while (i > 0 && keep[i - 1] > fd) {
        keep[i] = keep[i - 1];
        i--;
    }
    keep[i] = fd;
    (*n)++;
}

static void *take_stack(void)
{
    if (stack_pool_len > 0)
        return stack_pool[--stack_pool_len];
    void *stack = mmap(NULL, CHILD_STACK_SIZE, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        return NULL;
    }
    return stack;
}

static void give_stack(void *stack)
{
    if (stack_pool_len < STACK_POOL_MAX)
        stack_pool[stack_pool_len++] = stack;
    else
        munmap(stack, CHILD_STACK_SIZE);
}

/* `seq` as a new tuple; a TypeError saying `message` when it is not iterable (what
 * PySequence_Fast does, which the stable ABI lacks the item macros for). */
static PyObject *as_tuple(PyObject *seq, const char *message)
{
    PyObject *items = PySequence_Tuple(seq);
    if (!items && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, message);
    }
    return items;
}

/* `seq` (str, bytes or path-like items) as a tuple of bytes, each converted with the filesystem
 * encoding as _posixsubprocess.fork_exec converts its args (ValueError for an embedded null byte). */
static PyObject *fs_tuple(PyObject *seq)
{
    PyObject *items = as_tuple(seq, "expected a sequence");
    if (!items)
        return NULL;
    Py_ssize_t n = PyTuple_Size(items);
    PyObject *out = PyTuple_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *converted = NULL;
        if (!PyUnicode_FSConverter(PyTuple_GetItem(items, i), &converted))
            Py_CLEAR(out);
        else
            PyTuple_SetItem(out, i, converted);  /* steals the reference */
    }
    Py_DECREF(items);
    return out;
}

/* A NULL-terminated char* array pointing into the bytes objects of `seq` (kept alive in *keep);
 * `convert`: items may be str or path-like too (fs_tuple). */
static char **bytes_array(PyObject *seq, PyObject **keep, int convert)
{
    PyObject *tuple = convert ? fs_tuple(seq) : PySequence_Tuple(seq);
    if (!tuple)
        return NULL;
    Py_ssize_t n = PyTuple_Size(tuple);
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (!out) {
        Py_DECREF(tuple);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GetItem(tuple, i);
        if (!PyBytes_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "expected a sequence of bytes");
            goto fail;
        }
        if ((Py_ssize_t)strlen(PyBytes_AsString(item)) != PyBytes_Size(item)) {
            PyErr_SetString(PyExc_ValueError, "embedded null byte");
            goto fail;
        }
        out[i] = PyBytes_AsString(item);
    }
    *keep = tuple;
    return out;
fail:
    PyMem_Free(out);
    Py_DECREF(tuple);
    return NULL;
}

/* The child's environment: `base` (a NULL-terminated KEY=VALUE array: env_list, or environ as execv
 * would pass it) without the names `extra` sets, then `extra`. Pointers only, into strings that stay
 * alive across the clone: env_list's are held by this call, and glibc's setenv/unsetenv never free a
 * string once it was in environ (another thread may change the environment while the GIL is free). */
static char **merged_env(char *const *base, char *const *extra, Py_ssize_t n_extra)
{
    Py_ssize_t n_base = 0, n = 0;
    while (base[n_base])
        n_base++;
    char **out = PyMem_Calloc((size_t)(n_base + n_extra) + 1, sizeof(char *));
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n_base; i++) {
        const char *eq = strchr(base[i], '=');
        size_t len = eq ? (size_t)(eq - base[i]) + 1 : strlen(base[i]);
        int overridden = 0;
        for (Py_ssize_t j = 0; j < n_extra && !overridden; j++)
            overridden = strncmp(base[i], extra[j], len) == 0;
        if (!overridden)
            out[n++] = base[i];
    }
    for (Py_ssize_t j = 0; j < n_extra; j++)
        out[n++] = extra[j];
    return out;
}

static int *int_array(PyObject *seq, Py_ssize_t *count)
{
    PyObject *items = as_tuple(seq, "expected a sequence of ints");
    if (!items)
        return NULL;
    Py_ssize_t n = PyTuple_Size(items);
    int *out = PyMem_Calloc((size_t)n + 1, sizeof(int));
    if (!out) {
        Py_DECREF(items);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long v = PyLong_AsLong(PyTuple_GetItem(items, i));
        if (v == -1 && PyErr_Occurred()) {
            PyMem_Free(out);
            Py_DECREF(items);
            return NULL;
        }
        out[i] = (int)v;
    }
    Py_DECREF(items);
    *count = n;
    return out;
}

PyDoc_STRVAR(spawn_doc,
"spawn(args, executable_list, close_fds, fds_to_keep, cwd, env_list, extra_env,\n"
"      p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,\n"
"      restore_signals, start_new_session, process_group, umask, cgroup, join_fds[, seal])\n"
"      -> pid | (pid, report) | None\n\n"
"Start a child in a cgroup (clone3 CLONE_INTO_CGROUP|CLONE_VFORK|CLONE_VM) and\n"
"exec the first of executable_list that runs. Arguments follow _posixsubprocess.fork_exec (args:\n"
"str, bytes or path-like, converted with the filesystem encoding); join_fds\n"
"are open cgroup.procs files (cgroup v1) the child joins first. extra_env (KEY=VALUE bytes) is\n"
"added to env_list (None: this process's environment), replacing the variables it names.\n"
"cgroup is the fd of an open cgroup directory (-1: none), or (path, key, expected): then the\n"
"directory is opened and locked (flock LOCK_SH, held until the child has exec'd) and the child is\n"
"cloned only if its xattr key still holds exactly expected; None, starting nothing, if not.\n"
"The lock is waited for at most 2 s: OSError ETIMEDOUT with the path, nothing started.\n"
"A child that fails before or at exec reports 'OSError:<hex errno>:<stage>' through a CLOEXEC\n"
"pipe of this call's own and exits 255: then (pid, report); the caller reaps it.\n"
"seal (None: not sealed) builds a sealed turn's sandbox in the child (backends/seal.py, native):\n"
"then the child is PID 1 of new PID, mount and IPC namespaces, an init that forks the target.\n"
"Raises OSError when the open, the lock or clone3 itself fails.");

/* spawn()'s arguments as Python objects, before conversion (borrowed from the argument tuple). */
struct request {
    PyObject *args, *exec_list, *keep_seq, *cwd_obj, *env_obj, *extra_obj, *join_seq;
    PyObject *path_arg;         /* the checked spawn's path as given (for the OSError's filename) */
    int cgroup_fd;              /* -1: no fd given (a checked spawn, or no cgroup at all) */
    PyObject *seal_obj;         /* NULL or None: not sealed */
};

/* What one spawn() call owns until it returns: every reference and buffer is released by
 * release_held(), whichever step failed. */
struct held {
    PyObject *path_obj;         /* the checked spawn's path as bytes (the dir pool's key) */
    PyObject *argv_t, *exec_t, *env_t, *extra_t;  /* the bytes objects the char* arrays point into */
    char **argv, **execs, **envp, **extra, **merged;
    int *keep, *join;
    char *chk_buf;
    int errfds[2];
};

/* The seal's tuple (backends/seal.py, native()) into `s`, whose strings point into its bytes
 * objects (alive for the call: the argument tuple holds it):
 * ((path, flags)..., ), (proc path...), cwd, filter, caps, last_cap, netns_fd.
 * 0 with a Python error set on failure. */
static int parse_seal(PyObject *obj, struct seal *s)
{
    PyObject *binds, *proc_ro, *cwd, *filter;
    unsigned long long caps;
    char *program;
    Py_ssize_t program_len;
    if (!PyArg_ParseTuple(obj, "O!O!O!O!Kii:seal", &PyTuple_Type, &binds, &PyTuple_Type, &proc_ro,
                          &PyBytes_Type, &cwd, &PyBytes_Type, &filter, &caps, &s->last_cap, &s->netns_fd))
        return 0;
    if (PyTuple_Size(binds) > SEAL_MAX_BINDS || PyTuple_Size(proc_ro) > SEAL_MAX_PROC_RO) {
        PyErr_SetString(PyExc_ValueError, "a sealed spawn binds at most 32 paths");
        return 0;
    }
    s->n_binds = (int)PyTuple_Size(binds);
    for (int i = 0; i < s->n_binds; i++) {
        PyObject *path;
        if (!PyArg_ParseTuple(PyTuple_GetItem(binds, i), "O!i:bind", &PyBytes_Type, &path, &s->bind_flags[i]))
            return 0;
        s->bind_path[i] = PyBytes_AsString(path);
    }
    s->n_proc_ro = (int)PyTuple_Size(proc_ro);
    for (int i = 0; i < s->n_proc_ro; i++) {
        PyObject *path = PyTuple_GetItem(proc_ro, i);
        if (!PyBytes_Check(path)) {
            PyErr_SetString(PyExc_TypeError, "the seal's /proc paths must be bytes");
            return 0;
        }
        s->proc_ro[i] = PyBytes_AsString(path);
    }
    s->cwd = PyBytes_AsString(cwd);
    if (PyBytes_AsStringAndSize(filter, &program, &program_len) != 0)
        return 0;
    if (program_len == 0 || program_len % 8 != 0 || program_len / 8 > 4096) {
        PyErr_SetString(PyExc_ValueError, "the seal's filter must be whole struct sock_filter records");
        return 0;
    }
    s->filter = program;
    s->filter_len = (unsigned short)(program_len / 8);
    s->caps = caps;
    return 1;
}

/* The memfd the sandbox's PID 1 execs the init from (SEAL_INIT_ELF): made once per process, sealed
 * against any change, close-on-exec. -1 with a Python error set on failure. */
static int seal_init_fd = -1;

static int seal_init_memfd(void)
{
    if (seal_init_fd >= 0)
        return seal_init_fd;
    /* MFD_CLOEXEC | MFD_ALLOW_SEALING, and MFD_EXEC (Linux 6.3: where vm.memfd_noexec asks for it) */
    int fd = (int)syscall(SYS_memfd_create, "cgturn-init", 0x1U | 0x2U | 0x10U);
    if (fd < 0 && errno == EINVAL)
        fd = (int)syscall(SYS_memfd_create, "cgturn-init", 0x1U | 0x2U);
    if (fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    size_t done = 0;
    while (done < sizeof SEAL_INIT_ELF) {
        ssize_t n = write(fd, SEAL_INIT_ELF + done, sizeof SEAL_INIT_ELF - done);
        if (n <= 0 && errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            close(fd);
            return -1;
        }
        if (n > 0)
            done += (size_t)n;
    }
    /* F_ADD_SEALS: F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE */
    if (raw_fcntl(fd, 1033, 0x1 | 0x2 | 0x4 | 0x8) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        close(fd);
        return -1;
    }
    seal_init_fd = fd;
    return fd;
}

/* Step 1, parse: the argument tuple into `rq`, `chk` (a checked spawn's target) and the plain ints
 * of `c`. 0 with a Python error set on failure. */
static int parse_request(PyObject *a, struct request *rq, struct checked *chk, struct child *c,
                         struct held *h)
{
    PyObject *cgroup_obj, *expected;
    if (!PyArg_ParseTuple(a, "OOpOOOOiiiiiippiiOO|O:spawn", &rq->args, &rq->exec_list, &c->close_fds,
                          &rq->keep_seq, &rq->cwd_obj, &rq->env_obj, &rq->extra_obj, &c->p2cread,
                          &c->p2cwrite, &c->c2pread, &c->c2pwrite, &c->errread, &c->errwrite,
                          &c->restore_signals, &c->start_new_session, &c->process_group,
                          &c->umask_value, &cgroup_obj, &rq->join_seq, &rq->seal_obj))
        return 0;
    rq->cgroup_fd = -1;
    if (PyTuple_Check(cgroup_obj)) {
        /* No '#' format here or in Py_BuildValue below: the length's type depends on
         * PY_SSIZE_T_CLEAN, which 3.13's headers no longer map to the _SizeT functions, so a build
         * against them would call 3.12's int-length PyArg_ParseTuple (SystemError at run time). */
        char *value;
        if (!PyArg_ParseTuple(cgroup_obj, "OyO:cgroup", &rq->path_arg, &chk->key, &expected)
            || PyBytes_AsStringAndSize(expected, &value, &chk->expected_len) != 0
            || !PyUnicode_FSConverter(rq->path_arg, &h->path_obj))
            return 0;
        chk->expected = value;
        chk->path = PyBytes_AsString(h->path_obj);
        return 1;
    }
    long fd = PyLong_AsLong(cgroup_obj);
    if (fd == -1 && PyErr_Occurred())
        return 0;
    rq->cgroup_fd = fd >= 0 && fd <= INT_MAX ? (int)fd : -1;
    return 1;
}

/* Step 2, convert: the Python sequences into the C arrays the child reads (pointing into bytes
 * objects `h` keeps alive), and the check's read buffer. 0 with a Python error set on failure. */
static int convert_request(const struct request *rq, struct checked *chk, struct child *c,
                           struct held *h)
{
    if (!(h->argv = bytes_array(rq->args, &h->argv_t, 1))
        || !(h->execs = bytes_array(rq->exec_list, &h->exec_t, 0)))
        return 0;
    if (rq->env_obj != Py_None && !(h->envp = bytes_array(rq->env_obj, &h->env_t, 0)))
        return 0;
    if (!(h->extra = bytes_array(rq->extra_obj, &h->extra_t, 0)))
        return 0;
    Py_ssize_t n_extra = PyTuple_Size(h->extra_t);
    if (n_extra > 0 && !(h->merged = merged_env(h->envp ? h->envp : environ, h->extra, n_extra)))
        return 0;
    if (rq->cwd_obj != Py_None && !PyBytes_Check(rq->cwd_obj)) {
        PyErr_SetString(PyExc_TypeError, "cwd must be bytes or None");
        return 0;
    }
    if (!(h->keep = int_array(rq->keep_seq, &c->n_keep)) || !(h->join = int_array(rq->join_seq, &c->n_join)))
        return 0;
    if (chk->path && !(chk->buf = h->chk_buf = PyMem_Malloc((size_t)chk->expected_len + 1))) {
        PyErr_NoMemory();
        return 0;
    }
    c->argv = h->argv;
    c->exec_list = h->execs;
    c->envp = h->merged ? h->merged : h->envp;
    c->cwd = rq->cwd_obj == Py_None ? NULL : PyBytes_AsString(rq->cwd_obj);
    c->keep = h->keep;
    c->join = h->join;
    if (errpipe(h->errfds) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return 0;
    }
    c->errpipe_write = h->errfds[1];
    keep_insert(h->keep, &c->n_keep, h->errfds[1]);  /* int_array left room for it */
    return 1;
}

/* A Python error is set (returned by clone_checked instead of a pid or -errno). */
#define PY_ERROR (-(long)INT_MAX - 2)

/* Step 3b, clone for a checked spawn: first with a directory fd kept from an earlier spawn into the
 * same path; if that says "changed" or ENODEV, the directory may have been removed (and made again)
 * since, so a fresh open decides. The pid, CHANGED, -errno of the lock or clone, or PY_ERROR. */
static long clone_checked(const struct request *rq, const struct checked *chk, PyObject *path_obj,
                          struct clone_args_v2 *cl, struct child *c)
{
    long pid = CHANGED;
    for (int fresh = 0; fresh < 2; fresh++) {
        int fd = fresh ? -1 : dir_pool_take(path_obj);
        int pooled = fd >= 0;
        if (!pooled && (fd = open(chk->path, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0) {
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, rq->path_arg);
            return PY_ERROR;
        }
        if (inflight_add(fd) != 0) {
            close(fd);
            PyErr_SetString(PyExc_RuntimeError, "too many checked spawns in flight");
            return PY_ERROR;
        }
        cl->cgroup = (uint64_t)fd;
        Py_BEGIN_ALLOW_THREADS
        pid = checked_clone(fd, chk, cl, c);
        Py_END_ALLOW_THREADS
        inflight_remove(fd);
        int changed = pid == CHANGED;
        int failed = pid < 0 && !changed;
        if (pooled && (changed || (failed && -pid == ENODEV))) {
            close(fd);
            continue;
        }
        if (failed)
            close(fd);
        else
            dir_pool_give(path_obj, fd);
        break;
    }
    return pid;
}

/* Step 3, clone: on a pooled stack, into rq's cgroup fd, chk's checked directory, or no cgroup.
 * The pid, CHANGED, -errno, or PY_ERROR. Closes the parent's copy of the report pipe's write end,
 * so that reading the report ends at the child's exec or exit. */
static long clone_request(const struct request *rq, const struct checked *chk, struct child *c,
                          struct held *h)
{
    void *stack = take_stack();
    if (!stack)
        return PY_ERROR;
    struct clone_args_v2 cl;
    memset(&cl, 0, sizeof cl);
    cl.flags = CLONE_VM | CLONE_VFORK | (rq->cgroup_fd >= 0 || chk->path ? CLONE_INTO_CGROUP : 0);
    if (c->seal)  /* it is PID 1 there; it execs the init (seal_enter) */
        cl.flags |= CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC;
    cl.exit_signal = SIGCHLD;
    cl.stack = (uint64_t)(uintptr_t)stack;
    cl.stack_size = CHILD_STACK_SIZE;
    cl.cgroup = rq->cgroup_fd >= 0 ? (uint64_t)rq->cgroup_fd : 0;
    long pid;
    if (chk->path) {
        pid = clone_checked(rq, chk, h->path_obj, &cl, c);
    } else {
        Py_BEGIN_ALLOW_THREADS
        pid = clone_child(&cl, c);
        Py_END_ALLOW_THREADS
    }
    give_stack(stack);
    close(h->errfds[1]);
    h->errfds[1] = -1;
    return pid;
}

/* Step 4, the result: the child's report, if it wrote one, from the pipe, else from the parent's memory
 * (struct child_failure: a pipe the child's memory cgroup could not write to). CLONE_VFORK: the child
 * has exec'd (its copy of the pipe closes with the exec) or reported and exited; EOF comes at once
 * either way. */
static PyObject *child_result(long pid, int errread_fd, const struct child_failure *failure)
{
    char report_buf[256];
    ssize_t got = 0, n;
    Py_BEGIN_ALLOW_THREADS
    while (got < (ssize_t)sizeof(report_buf)) {
        n = read(errread_fd, report_buf + got, sizeof(report_buf) - (size_t)got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += n;
    }
    Py_END_ALLOW_THREADS
    if (got == 0 && failure->err == 0)
        return PyLong_FromLong(pid);
    PyObject *report = got > 0 ? PyBytes_FromStringAndSize(report_buf, got)
                               : PyBytes_FromFormat("OSError:%x:%s", (unsigned int)failure->err, failure->stage);
    return report ? Py_BuildValue("(lN)", pid, report) : NULL;  /* N: the tuple takes the reference */
}

/* Step 5, clean up: whatever the steps before got, whichever of them failed. */
static void release_held(struct held *h)
{
    for (int i = 0; i < 2; i++)
        if (h->errfds[i] >= 0)
            close(h->errfds[i]);
    PyMem_Free(h->chk_buf);
    PyMem_Free(h->argv);
    PyMem_Free(h->execs);
    PyMem_Free(h->envp);
    PyMem_Free(h->extra);
    PyMem_Free(h->merged);
    PyMem_Free(h->keep);
    PyMem_Free(h->join);
    Py_XDECREF(h->path_obj);
    Py_XDECREF(h->argv_t);
    Py_XDECREF(h->exec_t);
    Py_XDECREF(h->env_t);
    Py_XDECREF(h->extra_t);
}

static PyObject *spawn(PyObject *self, PyObject *a)
{
    struct request rq;
    struct checked chk;
    struct child c;
    struct child_failure failure = {0, ""};
    struct held h;
    memset(&rq, 0, sizeof rq);
    memset(&chk, 0, sizeof chk);
    memset(&c, 0, sizeof c);
    memset(&h, 0, sizeof h);
    struct seal seal;
    memset(&seal, 0, sizeof seal);
    c.failure = &failure;
    h.errfds[0] = h.errfds[1] = -1;
    PyObject *result = NULL;
    int parsed = parse_request(a, &rq, &chk, &c, &h);
    if (parsed && rq.seal_obj && rq.seal_obj != Py_None) {
        parsed = parse_seal(rq.seal_obj, &seal);
        c.seal = &seal;
    }
    if (parsed && c.seal && ((seal.init_fd = seal_init_memfd()) < 0 || !(seal.target_stack = take_stack())))
        parsed = 0;
    if (parsed && convert_request(&rq, &chk, &c, &h)) {
        long pid = clone_request(&rq, &chk, &c, &h);
        if (pid == CHANGED) {
            result = Py_NewRef(Py_None);
        } else if (pid == LOCK_TIMEOUT) {
            errno = ETIMEDOUT;  /* kernel/spawn.py raises it as LockTimeout */
            PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, rq.path_arg);
        } else if (pid < 0 && pid != PY_ERROR) {
            errno = (int)-pid;
            PyErr_SetFromErrno(PyExc_OSError);
        } else if (pid > 0) {
            result = child_result(pid, h.errfds[0], &failure);
        }
    }
    if (seal.target_stack)
        give_stack(seal.target_stack);
    release_held(&h);
    return result;
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS, spawn_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cgturn._spawn",
    "clone3(CLONE_INTO_CGROUP) spawn for cgturn: the child starts in the turn's cgroup.", -1, methods,
};

PyMODINIT_FUNC PyInit__spawn(void)
{
    if (pthread_atfork(NULL, NULL, close_inflight_in_child) != 0) {
        PyErr_SetString(PyExc_ImportError, "cgturn._spawn: pthread_atfork failed");
        return NULL;
    }
    return PyModule_Create(&module);
}
