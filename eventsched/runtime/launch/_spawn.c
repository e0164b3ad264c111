/* The supervisor's launch accelerator: start() (supervisor.py) without
 * copying the supervisor's memory.
 *
 * The portable start() forks a child that joins the job's cgroup, takes the
 * job's limits and identity, and execs. The fork copies the page tables and
 * then every page either process writes, and joining a cgroup after birth
 * waits for an RCU grace period. posix_spawn avoids the copy (vfork) but
 * cannot place the child in a cgroup before glibc 2.41.
 *
 * spawn() here is posix_spawn with that missing attribute: clone3 with
 * CLONE_VM | CLONE_VFORK | CLONE_INTO_CGROUP on a stack of its own, a child
 * that makes only raw system calls (it shares our memory until it execs) in
 * the order of the portable child's steps, and the failed step and errno
 * handed back in that shared memory. x86-64 only; elsewhere the module has
 * no spawn() and the supervisor forks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if defined(__x86_64__) && defined(__linux__)
#define ESCHED_HAVE_SPAWN 1
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#ifndef CLONE_INTO_CGROUP
#define CLONE_INTO_CGROUP 0x200000000ULL
#endif
#ifndef CLONE_CLEAR_SIGHAND
#define CLONE_CLEAR_SIGHAND 0x100000000ULL
#endif
#ifndef SYS_clone3
#define SYS_clone3 435
#endif
#ifndef SYS_close_range
#define SYS_close_range 436
#endif

struct esched_clone_args { /* struct clone_args, Linux 5.7+ (with cgroup) */
    uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid,
        set_tid_size, cgroup;
};

struct esched_rlimit {
    int resource;
    uint64_t soft, hard;
};

/* What the child needs, all prepared by the parent: it must not allocate. */
struct esched_plan {
    char *const *paths; /* where to look for the program, in order */
    Py_ssize_t npaths;
    char *const *argv;
    char *const *envp;
    const char *memory_cgroup_procs; /* a v1 cgroup's cgroup.procs to join, or NULL */
    const char *cwd;
    int umask;                       /* -1: keep */
    const int *default_signals;
    Py_ssize_t ndefault_signals;
    const struct esched_rlimit *rlimits;
    Py_ssize_t nrlimits;
    int switch_identity;
    uint32_t uid, gid;
    const uint32_t *groups;
    Py_ssize_t ngroups;
    /* written by the child when it fails (the parent reads them once we resume) */
    volatile int failed_step;
    volatile int failed_errno;
};

/* the steps, in the order the child takes them; the names are Python's */
enum { STEP_NONE, STEP_SIGNALS, STEP_SETSID, STEP_MEMORY_CGROUP, STEP_CLOSE, STEP_UMASK,
       STEP_RLIMITS, STEP_IDENTITY, STEP_CWD, STEP_EXEC };

static int child_fail(struct esched_plan *plan, int step, long err)
{
    plan->failed_step = step;
    plan->failed_errno = (int)err;
    return 127;
}

/* Raw system calls only: this runs on our memory, with our thread's TLS. */
static int child_main(void *arg)
{
    struct esched_plan *plan = arg;
    struct { uintptr_t handler; unsigned long flags; uintptr_t restorer; uint64_t mask; } dfl = {0, 0, 0, 0};
    uint64_t no_signals = 0;
    long r;

    for (Py_ssize_t i = 0; i < plan->ndefault_signals; i++) /* ignored ones survive exec */
        if (syscall(SYS_rt_sigaction, plan->default_signals[i], &dfl, NULL, 8) != 0)
            return child_fail(plan, STEP_SIGNALS, errno);
    if (syscall(SYS_setsid) < 0) /* its own session and process group: pgid == pid */
        return child_fail(plan, STEP_SETSID, errno);
    if (plan->memory_cgroup_procs) {
        int fd = (int)syscall(SYS_openat, AT_FDCWD, plan->memory_cgroup_procs, O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            return child_fail(plan, STEP_MEMORY_CGROUP, errno);
        r = syscall(SYS_write, fd, "0", 1);
        long err = errno;
        syscall(SYS_close, fd);
        if (r != 1)
            return child_fail(plan, STEP_MEMORY_CGROUP, r < 0 ? err : EIO);
    }
    /* keep 0-2 (/dev/null, log, log) */
    if (syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
        if (errno != ENOSYS)
            return child_fail(plan, STEP_CLOSE, errno);
        for (int fd = 3; fd < 65536; fd++)
            syscall(SYS_close, fd);
    }
    if (plan->umask >= 0)
        syscall(SYS_umask, plan->umask);
    for (Py_ssize_t i = 0; i < plan->nrlimits; i++) { /* before setuid: lowers, never raises */
        uint64_t lim[2] = {plan->rlimits[i].soft, plan->rlimits[i].hard};
        if (syscall(SYS_prlimit64, 0, plan->rlimits[i].resource, lim, NULL) != 0)
            return child_fail(plan, STEP_RLIMITS, errno);
    }
    if (plan->switch_identity) { /* groups first, uid last: once uid changes we may not change groups */
        if (syscall(SYS_setgroups, (size_t)plan->ngroups, plan->groups) != 0
            || syscall(SYS_setgid, plan->gid) != 0 || syscall(SYS_setuid, plan->uid) != 0)
            return child_fail(plan, STEP_IDENTITY, errno);
    }
    if (syscall(SYS_chdir, plan->cwd) != 0) /* as the user, so permissions apply */
        return child_fail(plan, STEP_CWD, errno);
    if (syscall(SYS_rt_sigprocmask, SIG_SETMASK, &no_signals, NULL, 8) != 0)
        return child_fail(plan, STEP_SIGNALS, errno);
    /* like execvp: ENOENT and ENOTDIR mean "look further"; another error
     * (EACCES...) is remembered and reported if nothing else runs */
    int saved = 0, last = ENOENT;
    for (Py_ssize_t i = 0; i < plan->npaths; i++) {
        syscall(SYS_execve, plan->paths[i], plan->argv, plan->envp);
        last = errno;
        if (last != ENOENT && last != ENOTDIR && saved == 0)
            saved = last;
    }
    /* nothing ran: block again so no signal handler of ours runs on our memory */
    uint64_t all = ~(uint64_t)0;
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &all, NULL, 8);
    return child_fail(plan, STEP_EXEC, saved ? saved : last);
}

/* clone3 onto a new stack; the child calls fn(arg) there and exits with its
 * result. The parent gets the pid (or -errno) back once the child has exec'd
 * or exited (CLONE_VFORK). */
static long clone3_call(struct esched_clone_args *args, int (*fn)(void *), void *arg)
{
    register long rax __asm__("rax") = SYS_clone3;
    register void *r12 __asm__("r12") = arg;
    register void *r13 __asm__("r13") = (void *)fn;
    __asm__ volatile(
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 1f\n\t"
        /* the child, on its own stack (16-byte aligned by the kernel's top) */
        "xor %%ebp, %%ebp\n\t"
        "mov %%r12, %%rdi\n\t"
        "call *%%r13\n\t"
        "mov %%eax, %%edi\n\t"
        "mov $231, %%eax\n\t" /* exit_group */
        "syscall\n\t"
        "ud2\n"
        "1:\n\t"
        : "+r"(rax)
        : "D"(args), "S"(sizeof(*args)), "r"(r12), "r"(r13)
        : "rcx", "r11", "memory");
    return rax;
}

#define CHILD_STACK (64 * 1024)

static const char *const step_names[] = {
    "", "reset signals", "setsid", "join memory cgroup", "close descriptors", "set umask",
    "set resource limits", "switch identity", "change directory", "execute",
};

/* Fill a NULL-terminated char* array from a sequence of bytes (borrowed
 * pointers into the bytes objects, which the caller keeps alive). */
static char **bytes_array(PyObject *seq, Py_ssize_t *n_out, PyObject **keep)
{
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of bytes");
    if (!fast)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (!out) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(fast, i);
        if (!PyBytes_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "expected bytes");
            goto fail;
        }
        if ((Py_ssize_t)strlen(PyBytes_AS_STRING(item)) != PyBytes_GET_SIZE(item)) {
            PyErr_SetString(PyExc_ValueError, "embedded null byte");
            goto fail;
        }
        out[i] = PyBytes_AS_STRING(item);
    }
    if (n_out)
        *n_out = n;
    *keep = fast; /* the items stay alive as long as this list */
    return out;
fail:
    PyMem_Free(out);
    Py_DECREF(fast);
    return NULL;
}

PyDoc_STRVAR(spawn_doc,
"spawn(paths, argv, envp, cgroup_fd, memory_cgroup_procs, cwd, umask, default_signals,\n"
"      rlimits, identity) -> (pid, step, errno)\n\n"
"Start the program at the first of ``paths`` that runs, born in the cgroup\n"
"open at ``cgroup_fd`` (-1: ours). ``rlimits``: [(resource, soft, hard)], -1 =\n"
"infinity. ``identity``: None, or (uid, gid, groups) to switch to. Returns\n"
"(pid, \"\", 0) once it runs; (-1, step, errno) when ``step`` failed (the child,\n"
"if any, is already reaped); raises OSError when clone3 itself fails.");

static PyObject *spawn(PyObject *Py_UNUSED(self), PyObject *args)
{
    PyObject *paths_o, *argv_o, *envp_o, *memcg_o, *signals_o, *rlimits_o, *identity_o;
    const char *cwd;
    int cgroup_fd, umask_value;
    if (!PyArg_ParseTuple(args, "OOOiOyiOOO:spawn", &paths_o, &argv_o, &envp_o, &cgroup_fd, &memcg_o,
                          &cwd, &umask_value, &signals_o, &rlimits_o, &identity_o))
        return NULL;

    PyObject *keep_paths = NULL, *keep_argv = NULL, *keep_envp = NULL, *result = NULL;
    char **paths = NULL, **argv = NULL, **envp = NULL;
    int *signals = NULL;
    struct esched_rlimit *rlimits = NULL;
    uint32_t *groups = NULL;
    void *stack = MAP_FAILED;
    struct esched_plan plan;
    memset(&plan, 0, sizeof(plan));
    plan.umask = umask_value;
    plan.cwd = cwd;

    if (!(paths = bytes_array(paths_o, &plan.npaths, &keep_paths))
        || !(argv = bytes_array(argv_o, NULL, &keep_argv))
        || !(envp = bytes_array(envp_o, NULL, &keep_envp)))
        goto done;
    plan.paths = paths;
    plan.argv = argv;
    plan.envp = envp;
    if (memcg_o != Py_None) {
        if (!PyBytes_Check(memcg_o)) {
            PyErr_SetString(PyExc_TypeError, "memory_cgroup_procs: bytes or None");
            goto done;
        }
        plan.memory_cgroup_procs = PyBytes_AS_STRING(memcg_o);
    }

    Py_ssize_t n = PySequence_Size(signals_o);
    if (n < 0 || !(signals = PyMem_Calloc((size_t)n + 1, sizeof(int))))
        goto nomem_or_error;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(signals_o, i);
        signals[i] = item ? (int)PyLong_AsLong(item) : -1;
        Py_XDECREF(item);
        if (PyErr_Occurred())
            goto done;
    }
    plan.default_signals = signals;
    plan.ndefault_signals = n;

    n = PySequence_Size(rlimits_o);
    if (n < 0 || !(rlimits = PyMem_Calloc((size_t)n + 1, sizeof(*rlimits))))
        goto nomem_or_error;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(rlimits_o, i);
        long long soft = 0, hard = 0;
        int res = 0;
        if (!item || !PyArg_ParseTuple(item, "iLL", &res, &soft, &hard)) {
            Py_XDECREF(item);
            goto done;
        }
        Py_DECREF(item);
        rlimits[i].resource = res;
        rlimits[i].soft = soft < 0 ? ~(uint64_t)0 : (uint64_t)soft; /* -1: RLIM_INFINITY */
        rlimits[i].hard = hard < 0 ? ~(uint64_t)0 : (uint64_t)hard;
    }
    plan.rlimits = rlimits;
    plan.nrlimits = n;

    if (identity_o != Py_None) {
        PyObject *groups_o;
        unsigned int uid, gid;
        if (!PyArg_ParseTuple(identity_o, "IIO", &uid, &gid, &groups_o))
            goto done;
        n = PySequence_Size(groups_o);
        if (n < 0 || !(groups = PyMem_Calloc((size_t)n + 1, sizeof(uint32_t))))
            goto nomem_or_error;
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *item = PySequence_GetItem(groups_o, i);
            groups[i] = item ? (uint32_t)PyLong_AsUnsignedLong(item) : 0;
            Py_XDECREF(item);
            if (PyErr_Occurred())
                goto done;
        }
        plan.switch_identity = 1;
        plan.uid = uid;
        plan.gid = gid;
        plan.groups = groups;
        plan.ngroups = n;
    }

    stack = mmap(NULL, CHILD_STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED) {
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    struct esched_clone_args ca;
    memset(&ca, 0, sizeof(ca));
    ca.flags = CLONE_VM | CLONE_VFORK | CLONE_CLEAR_SIGHAND;
    if (cgroup_fd >= 0) {
        ca.flags |= CLONE_INTO_CGROUP;
        ca.cgroup = (uint64_t)cgroup_fd;
    }
    ca.exit_signal = SIGCHLD;
    ca.stack = (uint64_t)(uintptr_t)stack;
    ca.stack_size = CHILD_STACK;

    /* No handler of ours may run in the child (it shares our memory): block
     * everything across the clone; the child unblocks just before exec. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    long pid = clone3_call(&ca, child_main, &plan);
    pthread_sigmask(SIG_SETMASK, &old, NULL);

    if (pid < 0) {
        errno = (int)-pid;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    if (plan.failed_step != STEP_NONE) {
        int status;
        while (waitpid((pid_t)pid, &status, 0) < 0 && errno == EINTR)
            ;
        result = Py_BuildValue("(isi)", -1, step_names[plan.failed_step], plan.failed_errno);
    } else {
        result = Py_BuildValue("(isi)", (int)pid, "", 0);
    }
    goto done;

nomem_or_error:
    if (!PyErr_Occurred())
        PyErr_NoMemory();
done:
    if (stack != MAP_FAILED)
        munmap(stack, CHILD_STACK);
    PyMem_Free(paths);
    PyMem_Free(argv);
    PyMem_Free(envp);
    PyMem_Free(signals);
    PyMem_Free(rlimits);
    PyMem_Free(groups);
    Py_XDECREF(keep_paths);
    Py_XDECREF(keep_argv);
    Py_XDECREF(keep_envp);
    return result;
}
#endif

static PyMethodDef methods[] = {
#ifdef ESCHED_HAVE_SPAWN
    {"spawn", spawn, METH_VARARGS, spawn_doc},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_spawn",
    .m_doc = "posix_spawn into a cgroup (clone3 CLONE_VM|CLONE_VFORK|CLONE_INTO_CGROUP); see _spawn.c.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__spawn(void) { return PyModule_Create(&module); }
