/*
 * The ring thread's per-chunk work, in C: posting a request's chunks and counting the ones that
 * completed as asked.
 *
 * Why: the ring thread spends 5-10 us of Python per chunk on the host (building the SQE, the
 * in-flight table, the completion's bookkeeping). Against a disk that is noise; in the QEMU guest,
 * where every guest CPU microsecond is emulated on the host, it became 180-260 us per command
 * and held our NVMe passthrough at 0.52-0.71 of fio's (docs/bench.md). With this pump Python
 * runs per request and per exceptional completion, C per chunk.
 *
 * The contract with dualblade/io_engine/_chunk_pump.py, which owns all memory used here:
 *   - A slot describes one request's fresh chunks: its first chunk's SQE as the target built it
 *     (a template), the request's length, its chunk size, the next byte to post, and how to move
 *     the template to another chunk (a file command: addr, len and off; an NVMe command: the data
 *     pointer, data length, starting LBA and block count in the command area).
 *   - A pump chunk's user_data is PUMP_TAG | slot << SLOT_SHIFT | chunk index.
 *   - A completion that did what was asked (a file command: res == length; an NVMe command:
 *     res == 0) only counts in its slot, and the slot's next chunk takes its place in flight at
 *     once (a lane serves its first request until it has posted every chunk, so the same
 *     request is the one Python would have posted next). A request that has posted every chunk
 *     gives its place to the next request of its lane that Python has opened a slot for (the
 *     slot's successor, which Python links when it opens that slot). Every other completion
 *     (errors, short transfers, cancellations, Python's own commands, the wake-up) is handed back
 *     to Python as (user_data, res, big-CQE word), in order, for the Python path to handle as
 *     before.
 *   - db_pump_run waits (the caller releases the GIL: it is bound through ctypes.CDLL) and
 *     returns only when Python has something to do: a completion handed back, a request whose
 *     last chunk completed (its caller is told), or a chunk whose place in flight no pump chunk
 *     could take (its request was stopped, or neither it nor a successor has one left): its
 *     lane has room, and Python chooses what fills it.
 *
 * liburing is not linked: Python hands in the addresses of the liburing-ffi functions it already
 * loaded, so both sides use the same library and ring.
 */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <linux/io_uring.h>
#include <linux/nvme_ioctl.h>

#define DB_PUMP_ABI 3
#define PUMP_TAG (1ULL << 63)
#define SLOT_SHIFT 40
#define CHUNK_MASK ((1ULL << SLOT_SHIFT) - 1)
#define REAP_BATCH 64

enum { KIND_FILE = 0, KIND_NVME = 1 };

struct db_slot {
    uint8_t sqe[128];     /* chunk 0's SQE (the first 64 bytes on a ring of 64-byte SQEs) */
    uint64_t addr;        /* chunk 0's buffer address */
    uint64_t offset;      /* chunk 0's byte offset on the target */
    uint64_t length;      /* the request's bytes */
    uint64_t chunk;       /* bytes per chunk (the last one may be shorter) */
    uint64_t next_rel;    /* the next fresh chunk's offset in the request */
    uint32_t kind;        /* KIND_FILE or KIND_NVME */
    uint32_t lba_shift;   /* log2 of the LBA size (NVMe) */
    uint64_t done_chunks; /* completed as asked, since Python last took them */
    uint64_t done_bytes;
    uint64_t posted;      /* chunks posted here in a completed one's place, since then too */
    uint32_t touched;     /* listed in this reap's touched slots */
    uint32_t stopped;     /* set by Python (cancelled, failed): post no more of it */
    uint32_t inflight;    /* its chunks posted and not yet completed */
    uint32_t successor;   /* 1 + the slot of the next request of its lane, or 0 (set by Python) */
};

typedef void *(*get_sqe_fn)(void *ring);
typedef int (*submit_fn)(void *ring);
typedef unsigned (*peek_batch_fn)(void *ring, struct io_uring_cqe **cqes, unsigned count);
typedef void (*cq_advance_fn)(void *ring, unsigned count);
typedef int (*submit_and_wait_fn)(void *ring, unsigned wait_nr);

struct db_pump {
    void *ring;
    get_sqe_fn get_sqe;
    submit_fn submit;
    peek_batch_fn peek_batch;
    cq_advance_fn cq_advance;
    submit_and_wait_fn submit_and_wait;
    uint32_t sqe_bytes;   /* 64, or 128 on a passthrough ring */
    uint32_t big_cqe;     /* 1: 32-byte CQEs, whose second word is handed back too */
    uint32_t slot_count;
    uint32_t out_capacity; /* completions out holds */
    struct db_slot *slots;
    uint64_t *out;        /* completions handed back: (user_data, res, big-CQE word) each */
    uint32_t *touched;    /* slots with progress, each once, slot_count of room */
    uint32_t handed;      /* filled in by the last run or reap */
    uint32_t touched_count;
    uint32_t more;        /* out was full: completions may be waiting */
    uint32_t successor_posts; /* chunks posted in another request's place, ever (wraps) */
};

int db_pump_abi(void) { return DB_PUMP_ABI; }

int db_pump_slot_bytes(void) { return (int)sizeof(struct db_slot); }

int db_pump_bytes(void) { return (int)sizeof(struct db_pump); }

static void place_chunk(const struct db_slot *slot, struct io_uring_sqe *sqe, uint64_t rel,
                        uint64_t size) {
    if (slot->kind == KIND_NVME) {
        struct nvme_uring_cmd *cmd = (struct nvme_uring_cmd *)sqe->cmd;
        uint64_t slba = (slot->offset + rel) >> slot->lba_shift;
        cmd->addr = slot->addr + rel;
        cmd->data_len = (uint32_t)size;
        cmd->cdw10 = (uint32_t)slba;
        cmd->cdw11 = (uint32_t)(slba >> 32);
        cmd->cdw12 = (uint32_t)((size >> slot->lba_shift) - 1);
    } else {
        sqe->addr = slot->addr + rel;
        sqe->len = (uint32_t)size;
        sqe->off = slot->offset + rel;
    }
}

/*
 * Post up to max_chunks fresh chunks of slot slot_index, each submitted on its own (as the
 * Python path does: submitted together, the block layer's plug merged them and this VM's virtio
 * disk read them slower). Returns how many were posted; fewer when the SQ is full or the request
 * has none left. The slot's next_rel moves past them.
 */
static int post_chunk(struct db_pump *pump, uint32_t slot_index) {
    struct db_slot *slot = &pump->slots[slot_index];
    struct io_uring_sqe *sqe = pump->get_sqe(pump->ring);
    if (sqe == NULL)
        return 0;
    uint64_t rel = slot->next_rel;
    uint64_t size = slot->length - rel < slot->chunk ? slot->length - rel : slot->chunk;
    memcpy(sqe, slot->sqe, pump->sqe_bytes);
    place_chunk(slot, sqe, rel, size);
    sqe->user_data = PUMP_TAG | ((uint64_t)slot_index << SLOT_SHIFT) | (rel / slot->chunk);
    slot->next_rel = rel + size;
    slot->inflight++;
    pump->submit(pump->ring);
    return 1;
}

static void touch(struct db_pump *pump, uint32_t slot_index) {
    struct db_slot *slot = &pump->slots[slot_index];
    if (!slot->touched) {
        slot->touched = 1;
        pump->touched[pump->touched_count++] = slot_index;
    }
}

/*
 * Post the next fresh chunk of the first request after `slot` in its lane's order (its
 * successors) that has one, in the place of a chunk of `slot`, whose request has posted all
 * of its own. Without this, every completion of a request's last chunks came back to Python
 * for the lane's next request to be posted: about a queue depth of returns per request, and in
 * the QEMU guest, where each costs hundreds of emulated microseconds, the device's queue ran
 * short at every request's end. Returns 1 if a chunk was posted.
 */
static int post_successor(struct db_pump *pump, const struct db_slot *slot) {
    uint32_t next = slot->successor;
    for (uint32_t hops = 0; next != 0 && hops < pump->slot_count; hops++) {
        struct db_slot *later = &pump->slots[next - 1];
        if (!later->stopped && later->next_rel < later->length) {
            if (!post_chunk(pump, next - 1))
                return 0;
            later->posted++;
            pump->successor_posts++;
            touch(pump, next - 1);
            return 1;
        }
        next = later->successor;
    }
    return 0;
}

int db_pump_fill(struct db_pump *pump, uint32_t slot_index, uint32_t max_chunks) {
    struct db_slot *slot = &pump->slots[slot_index];
    uint32_t posted = 0;
    while (posted < max_chunks && slot->next_rel < slot->length && post_chunk(pump, slot_index))
        posted++;
    return (int)posted;
}

/* Did this completion do what its chunk asked? */
static int as_asked(const struct db_slot *slot, int32_t res, uint64_t size) {
    return slot->kind == KIND_NVME ? res == 0 : res >= 0 && (uint64_t)res == size;
}

/*
 * Reap every completion there is, appending to what the last call left (at most out_capacity
 * handed back). A pump chunk that did what it asked counts in its slot, the slot is listed once
 * in touched, and its request's next chunk is posted in its place, or, when the request has
 * posted them all, the next chunk of a later request of its lane (post_successor). Every other
 * completion is written to out. Returns 1 when Python has something to do (see the top of this file).
 */
static int reap_into(struct db_pump *pump) {
    struct io_uring_cqe *cqes[REAP_BATCH];
    int python = 0;
    for (;;) {
        uint32_t room = pump->out_capacity - pump->handed;
        uint32_t want = room < REAP_BATCH ? room : REAP_BATCH;
        if (want == 0) {
            pump->more = 1;
            return 1;
        }
        unsigned count = pump->peek_batch(pump->ring, cqes, want);
        for (unsigned i = 0; i < count; i++) {
            struct io_uring_cqe *cqe = cqes[i];
            uint64_t user_data = cqe->user_data;
            if (user_data & PUMP_TAG) {
                uint32_t slot_index = (uint32_t)((user_data & ~PUMP_TAG) >> SLOT_SHIFT);
                struct db_slot *slot = &pump->slots[slot_index];
                uint64_t rel = (user_data & CHUNK_MASK) * slot->chunk;
                uint64_t size = slot->length - rel < slot->chunk ? slot->length - rel : slot->chunk;
                slot->inflight--;
                if (as_asked(slot, cqe->res, size)) {
                    slot->done_chunks++;
                    slot->done_bytes += size;
                    touch(pump, slot_index);
                    if (slot->stopped)
                        python = 1;
                    else if (slot->next_rel < slot->length) {
                        if (post_chunk(pump, slot_index))
                            slot->posted++;
                        else
                            python = 1;
                    } else if (!post_successor(pump, slot) || slot->inflight == 0)
                        python = 1; /* its place is Python's to fill, or its caller is told */
                    continue;
                }
            }
            uint64_t *entry = &pump->out[3 * pump->handed++];
            entry[0] = user_data;
            entry[1] = (uint64_t)(int64_t)cqe->res;
            entry[2] = pump->big_cqe ? cqe->big_cqe[0] : 0;
            python = 1;
        }
        pump->cq_advance(pump->ring, count);
        if (count < want)
            return python;
    }
}

static void start_report(struct db_pump *pump) {
    pump->handed = 0;
    pump->touched_count = 0;
    pump->more = 0;
}

/* Reap without waiting (Python calls this while more is set). */
void db_pump_reap(struct db_pump *pump) {
    start_report(pump);
    reap_into(pump);
}

/*
 * Submit what is queued and wait, reaping and posting in C, until Python has something to do.
 * Returns io_uring_submit_and_wait's result: negative for an error that is not a mere wake-up
 * (EINTR, EAGAIN, EBUSY, ETIME are waited through).
 */
int db_pump_run(struct db_pump *pump) {
    start_report(pump);
    for (;;) {
        int rc = pump->submit_and_wait(pump->ring, 1);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY && rc != -ETIME)
            return rc;
        if (reap_into(pump))
            return rc < 0 ? 0 : rc;
    }
}
