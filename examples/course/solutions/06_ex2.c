/* 06_ex2.c - lesson 06, exercise 2: save on rank 0, load anywhere.

   PyTorch's DDP scripts save on rank 0 only (`if rank == 0: torch.save(...)`). In mgpu every rank
   calls mgpu_model_save on the distributed model; rank 0 writes the file and the others wait for
   it. Then every rank loads the checkpoint into a model of its own (one process, one device, not
   distributed) and checks that it holds the very bits of the job's replicas.

   Run:  mpirun -np 2 build/course/06_ex2_mpi                                  */
// course-run:
// course-mpirun 2:
// course-expect: every rank loaded the job's bits: yes
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BATCH 24
#define FEATURES 8
#define CLASSES 3

#define CHECK(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "rank %d, line %d: %s\n", mgpu_dist_rank(), __LINE__, mgpu_last_error()); mgpu_dist_abort(1); } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "rank %d, line %d: %s\n", mgpu_dist_rank(), __LINE__, mgpu_last_error()); mgpu_dist_abort(1); } } while (0)

static mgpu_model* make_model(mgpu_device_set* set, int distributed) {
    mgpu_layer* layers[3] = { mgpu_layer_linear(FEATURES, 16), mgpu_layer_relu(), mgpu_layer_linear(16, CLASSES) };
    return mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(FEATURES), .layers = layers, .layer_count = 3,
                                                  .devices = set, .distributed = distributed });
}

int main(int argc, char** argv) {
    mgpu_device_set* set;
    mgpu_model *job, *mine;
    mgpu_optimizer* opt;
    mgpu_tensor *x, *y, *xs, *ys;
    char path[64];
    float *a, *b;
    size_t bytes;
    int rank, size, step, i, same, all_same;
    mgpu_allreduce* vote;
    mgpu_tensor* flag;
    CHECK(mgpu_dist_init(&argc, &argv));
    rank = mgpu_dist_rank();
    size = mgpu_dist_size();
    NEED(set = mgpu_device_set_create("cpu"));
    NEED(job = make_model(set, 1));
    NEED(opt = mgpu_optimizer_create(job, &(mgpu_optimizer_desc){ .lr = 0.1f, .momentum = 0.9f }));
    NEED(x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, FEATURES)));
    NEED(y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH)));
    for (step = 0; step < 10; ++step) {   /* the same global batch everywhere; this rank's rows of it */
        const int rows = BATCH / size + (rank < BATCH % size), from = rank * (BATCH / size) + (rank < BATCH % size ? rank : BATCH % size);
        CHECK(mgpu_rand_normal(x, 2, (uint64_t)step * mgpu_rand_offsets(BATCH * FEATURES), 0.0f, 1.0f));
        for (i = 0; i < BATCH; ++i) ((int32_t*)mgpu_tensor_data(y))[i] = (i + step) % CLASSES;
        NEED(xs = mgpu_tensor_view_rows(x, from, rows));
        NEED(ys = mgpu_tensor_view_rows(y, from, rows));
        CHECK(mgpu_model_train_step(job, opt, xs, ys, NULL));
        mgpu_tensor_destroy(xs);
        mgpu_tensor_destroy(ys);
    }
    /* the file's name: the same on every rank (they share this machine's folder here) */
    snprintf(path, sizeof path, "06_ex2.%d.safetensors", size);
    CHECK(mgpu_model_save(job, opt, path));   /* collective: rank 0 writes, the others wait */
    NEED(mine = make_model(set, 0));          /* this process alone */
    CHECK(mgpu_model_load(mine, NULL, path));
    bytes = mgpu_tensor_bytes(mgpu_model_params(job, 0));
    NEED(a = (float*)malloc(bytes * 2));
    b = a + bytes / sizeof(float);
    CHECK(mgpu_tensor_download(mgpu_model_params(job, 0), a, bytes));
    CHECK(mgpu_tensor_download(mgpu_model_params(mine, 0), b, bytes));
    same = memcmp(a, b, bytes) == 0;
    printf("rank %d: the checkpoint holds %s bits as my replica\n", rank, same ? "the same" : "OTHER");
    /* every rank's verdict, summed across the ranks */
    {
        mgpu_device_set* cpu;
        NEED(cpu = mgpu_device_set_create("cpu"));
        NEED(vote = mgpu_allreduce_create_distributed(cpu, MGPU_ALLREDUCE_AUTO));
        NEED(flag = mgpu_tensor_create(mgpu_device_set_get(cpu, 0), MGPU_F32, mgpu_shape1(1)));
        ((float*)mgpu_tensor_data(flag))[0] = (float)same;
        CHECK(mgpu_allreduce_sum(vote, &flag, 1));
        all_same = ((float*)mgpu_tensor_data(flag))[0] == (float)size;
        mgpu_tensor_destroy(flag);
        mgpu_allreduce_destroy(vote);
        mgpu_device_set_destroy(cpu);
    }
    if (rank == 0) {
        printf("every rank loaded the job's bits: %s\n", all_same ? "yes" : "NO");
        remove(path);
    }
    free(a);
    mgpu_tensor_destroy(x);
    mgpu_tensor_destroy(y);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(mine);
    mgpu_model_destroy(job);
    mgpu_device_set_destroy(set);
    mgpu_dist_shutdown();
    return all_same ? 0 : 1;
}
