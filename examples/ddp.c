/* ddp.c - one process per device (PyTorch's DistributedDataParallel), beside data_parallel.c's
   one process for all devices (DataParallel). Built with mpicc and MGPU_MPI (make mpi), started
   by mpirun or Slurm's srun:

     mpirun -np 4 build/ddp_mpi          four processes, one device each ("auto": this rank's GPU,
                                         or the CPU)
     build/data_parallel cpu:4           the same training in one process with four replicas

   On CPUs (sums through MPI) both print the same losses, to the last digit: the same five moves,
   only spread over processes. (NCCL across GPUs sums in its own order: the last bits may differ.)
     1. REPLICATE  every process makes the model; rank 0's parameters are broadcast to the others
                   (a model with .distributed = 1 does it when it is made).
     2. SPLIT      every process builds the same global batch (same seed) and takes its rows:
                   B/N each, the first B%N ranks one more. (A loader with .shard_for reads only
                   those rows.)
     3. COMPUTE    forward, loss and backward on its rows, the loss gradient scaled by 1/B.
     4. REDUCE     the gradients summed across the processes: a communicator made with
                   mgpu_allreduce_create_distributed spans every process's devices (NCCL across
                   GPUs, MPI for CPU replicas), summing in rank order as one process would.
     5. UPDATE     every process takes the same optimizer step.
   mgpu_model_train_step does all of this on a distributed model (examples/train.c). */
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <string.h>

#define BATCH 60
#define FEATURES 20
#define CLASSES 3

/* A failure here fails this process; mgpu_dist_abort ends the others too, rather than leave them
   waiting in a sum this process will never join. */
#define TRY(call) do { if ((call) != MGPU_OK) { fprintf(stderr, "rank %d: %s\n", mgpu_dist_rank(), mgpu_last_error()); mgpu_dist_abort(1); } } while (0)
#define NEED(p) do { if (!(p)) { fprintf(stderr, "rank %d: %s\n", mgpu_dist_rank(), mgpu_last_error()); mgpu_dist_abort(1); } } while (0)

/* The toy task of data_parallel.c: the class is which third of the features sums highest. */
static void make_batch(mgpu_tensor* x, mgpu_tensor* y, int step) {
    float* px = (float*)mgpu_tensor_data(x);
    int32_t* py = (int32_t*)mgpu_tensor_data(y);
    int i, c, f;
    mgpu_rand_normal(x, 5, (uint64_t)step * mgpu_rand_offsets(BATCH * FEATURES), 0.0f, 1.0f);
    for (i = 0; i < BATCH; ++i) {
        float best = -1e30f;
        for (c = 0; c < CLASSES; ++c) {
            float s = 0.0f;
            for (f = c * FEATURES / CLASSES; f < (c + 1) * FEATURES / CLASSES; ++f) s += px[i * FEATURES + f];
            if (s > best) { best = s; py[i] = c; }
        }
    }
}

int main(int argc, char** argv) {
    mgpu_device_set *device, *cpu;
    mgpu_layer* layers[3];
    mgpu_model* model;
    mgpu_optimizer* opt;
    mgpu_allreduce *sum_grads, *sum_loss;
    mgpu_tensor *x, *y, *xs, *ys, *loss, *dout, *grads, *loss_part;
    int rank, ranks, rows, first, step;
    TRY(mgpu_dist_init(&argc, &argv));   /* MPI_Init: who am I, how many are we */
    rank = mgpu_dist_rank();
    ranks = mgpu_dist_size();
    NEED(device = mgpu_device_set_create("auto"));   /* this rank's GPU (its local rank's), or the CPU */
    if (mgpu_device_set_count(device) != 1) {   /* a machine with more GPUs than ranks */
        fprintf(stderr, "rank %d: 'auto' gave %d devices (%s): start one process per device (mpirun -np <GPUs>)\n", rank,
                mgpu_device_set_count(device), mgpu_device_set_spec(device));
        mgpu_dist_abort(1);
    }
    NEED(cpu = mgpu_device_set_create("cpu"));

    /* 1. REPLICATE: made by every rank, rank 0's parameters everywhere */
    layers[0] = mgpu_layer_linear(FEATURES, 32);
    layers[1] = mgpu_layer_relu();
    layers[2] = mgpu_layer_linear(32, CLASSES);
    NEED(model = mgpu_model_create(&(mgpu_model_desc){ .input = mgpu_shape1(FEATURES), .layers = layers, .layer_count = 3,
                                                        .devices = device, .distributed = 1 }));
    NEED(opt = mgpu_optimizer_create(model, &(mgpu_optimizer_desc){ .lr = 0.1f, .momentum = 0.9f }));
    NEED(sum_grads = mgpu_allreduce_create_distributed(device, MGPU_ALLREDUCE_AUTO));   /* every rank's device */
    NEED(sum_loss = mgpu_allreduce_create_distributed(cpu, MGPU_ALLREDUCE_AUTO));       /* and a CPU one, for the loss */
    if (rank == 0)
        printf("%d processes, one replica each (rank 0 on %s), all-reduce across processes: %s\n", ranks,
               mgpu_device_set_spec(device), mgpu_allreduce_name(mgpu_allreduce_backend(sum_grads)));

    /* this rank's rows of every batch */
    rows = BATCH / ranks + (rank < BATCH % ranks);
    first = rank * (BATCH / ranks) + (rank < BATCH % ranks ? rank : BATCH % ranks);
    NEED(x = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape2(BATCH, FEATURES)));
    NEED(y = mgpu_tensor_create(mgpu_device_cpu(), MGPU_I32, mgpu_shape1(BATCH)));
    NEED(xs = mgpu_tensor_create(mgpu_model_device(model, 0), MGPU_F32, mgpu_shape2(rows, FEATURES)));
    NEED(ys = mgpu_tensor_create(mgpu_model_device(model, 0), MGPU_I32, mgpu_shape1(rows)));
    NEED(loss = mgpu_tensor_create(mgpu_model_device(model, 0), MGPU_F32, mgpu_shape1(1)));
    NEED(dout = mgpu_tensor_create(mgpu_model_device(model, 0), MGPU_F32, mgpu_shape2(rows, CLASSES)));
    NEED(loss_part = mgpu_tensor_create(mgpu_device_cpu(), MGPU_F32, mgpu_shape1(1)));
    grads = mgpu_model_grads(model, 0);

    for (step = 0; step < 200; ++step) {
        mgpu_tensor *xv, *yv;
        const mgpu_tensor* logits;
        float l, total;
        make_batch(x, y, step);   /* the same global batch on every rank */
        TRY(mgpu_model_zero_grad(model));
        /* 2. SPLIT: this rank's rows */
        xv = mgpu_tensor_view_rows(x, first, rows);
        yv = mgpu_tensor_view_rows(y, first, rows);
        TRY(mgpu_tensor_copy(xs, xv));
        TRY(mgpu_tensor_copy(ys, yv));
        mgpu_tensor_destroy(xv);
        mgpu_tensor_destroy(yv);
        /* 3. COMPUTE: scaled by the WHOLE batch, so that the ranks' gradients add up to it */
        NEED(logits = mgpu_model_forward(model, 0, xs, 1));
        TRY(mgpu_softmax_cross_entropy(loss, dout, logits, ys, 1.0f / BATCH));
        TRY(mgpu_model_backward(model, 0, dout));
        /* 4. REDUCE: across the processes */
        TRY(mgpu_allreduce_sum(sum_grads, &grads, 1));
        /* 5. UPDATE */
        TRY(mgpu_optimizer_step(opt));
        /* the batch's mean loss: each rank's share, summed across the ranks in rank order */
        TRY(mgpu_tensor_download(loss, &l, sizeof l));
        ((float*)mgpu_tensor_data(loss_part))[0] = l * (float)rows / BATCH;
        TRY(mgpu_allreduce_sum(sum_loss, &loss_part, 1));
        total = ((float*)mgpu_tensor_data(loss_part))[0];
        if (rank == 0 && (step % 40 == 0 || step == 199)) printf("step %3d  loss %.4f\n", step, (double)total);
    }
    /* every process's replica the same, bit for bit */
    TRY(mgpu_model_verify_replicas(model));
    if (rank == 0) printf("all %d replicas hold identical parameters\n", ranks);

    mgpu_tensor_destroy(x); mgpu_tensor_destroy(y); mgpu_tensor_destroy(xs); mgpu_tensor_destroy(ys);
    mgpu_tensor_destroy(loss); mgpu_tensor_destroy(dout); mgpu_tensor_destroy(loss_part);
    mgpu_allreduce_destroy(sum_loss);
    mgpu_allreduce_destroy(sum_grads);
    mgpu_optimizer_destroy(opt);
    mgpu_model_destroy(model);
    mgpu_device_set_destroy(cpu);
    mgpu_device_set_destroy(device);
    mgpu_dist_shutdown();
    return 0;
}
