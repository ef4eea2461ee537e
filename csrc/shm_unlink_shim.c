/*
 * LD_PRELOAD wrapper around shm_unlink(3): an ENOENT on one of PyTorch's "/torch_*" segment names is success.
 *
 * Why: PyTorch's CUDA IPC keeps the reference-counter files of shared storages in POSIX shared memory
 * ("/torch_<pid>_..."). When the producer collects its IPC limbo while the receiver is still reaping its
 * references, or after another party already removed the file, shm_unlink fails with ENOENT and PyTorch
 * throws, which kills a trainer rank in the middle of a colocated weight sync. The file being gone is
 * exactly the state the caller asked for, so for those names ENOENT is not an error.
 *
 * Every other name, and every other errno, passes through unchanged.
 * Build: cc -shared -fPIC -O2 -o libk3_shm_unlink_shim.so shm_unlink_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <string.h>

static const char kTorchPrefix[] = "/torch_";

typedef int (*shm_unlink_fn)(const char *);

int shm_unlink(const char *name) {
    static shm_unlink_fn real_shm_unlink = NULL;
    if (real_shm_unlink == NULL) {
        real_shm_unlink = (shm_unlink_fn)dlsym(RTLD_NEXT, "shm_unlink");
        if (real_shm_unlink == NULL) {
            errno = ENOSYS;
            return -1;
        }
    }
    int saved_errno = errno;
    int rc = real_shm_unlink(name);
    if (rc != 0 && errno == ENOENT && name != NULL &&
        strncmp(name, kTorchPrefix, sizeof(kTorchPrefix) - 1) == 0) {
        errno = saved_errno;  /* success leaves errno as the caller had it */
        return 0;
    }
    return rc;
}
