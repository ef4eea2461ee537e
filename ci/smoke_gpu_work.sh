# Sourced by ci/smoke_gpu.sh: where the smoke's inputs (the checkpoint, its torch_dist copy, the data) and its run
# live. In RAM (a tmpfs: /dev/shm) when the host has room for them, else on disk. On the device's disk, writing the
# ~24 GB of the checkpoint and its copy took 100-110 s (0.2-0.5 GB/s): with the 401 s training run that is more than
# one 10-minute call; in RAM the writes go at memory speed.
#
#   smoke_gpu_work_dir NEED_GB RAM_DIR RAM_FREE_GB MEM_AVAILABLE_GB KEPT_GB DISK_DIR
#
# prints "DIR<TAB>why". KEPT_GB is what an earlier run's inputs already take in RAM_DIR/k3-smoke-gpu: they are reused,
# so that space counts as free. RAM is chosen when RAM_DIR has NEED_GB + SMOKE_GPU_SHM_SLACK_GB free (Ray's object
# store lives in /dev/shm too) and the host has NEED_GB + SMOKE_GPU_HOST_SLACK_GB available (the pinned host copies
# of both BF16 bases, 2 × 11.1 GiB, the trainer's saver backup and the engine's weight backup, and the processes).
SMOKE_GPU_SHM_SLACK_GB=16
SMOKE_GPU_HOST_SLACK_GB=40

smoke_gpu_work_dir() {
    local need=$1 ram_dir=$2 ram_free=$3 avail=$4 kept=$5 disk_dir=$6
    local room=$(( ram_free + kept )) host=$(( avail + kept ))
    if (( room >= need + SMOKE_GPU_SHM_SLACK_GB && host >= need + SMOKE_GPU_HOST_SLACK_GB )); then
        printf '%s\t%s\n' "$ram_dir/k3-smoke-gpu" \
            "in RAM: $ram_dir has $room GB for the inputs' ~$need GB, the host $host GB available"
    else
        printf '%s\t%s\n' "$disk_dir" "on disk: $ram_dir has $room GB (needs $(( need + SMOKE_GPU_SHM_SLACK_GB ))), \
the host $host GB available (needs $(( need + SMOKE_GPU_HOST_SLACK_GB )))"
    fi
}
