/* 06_ex1.c - lesson 06, exercise 1: who am I, and do our rows make the batch?

   Every rank prints its rank, the world size, its local rank (among the processes of its
   machine) and its device; then the ranks add up their rows of a batch of 50 with an all-reduce
   across the processes (torch.distributed.all_reduce of one number) and check that the sum is
   the batch. 50 rows on 3 ranks: 17, 17, 16.

   Run:  mpicc -std=c99 -O2 -DMGPU_MPI -I. examples/course/solutions/06_ex1.c -o build/course/06_ex1_mpi -lm -lpthread
         mpirun -np 3 build/course/06_ex1_mpi                                  */
// course-run:
// course-mpirun 2:
// course-mpirun 3:
// course-expect: the ranks' rows make the batch: 50
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>

#define BATCH 50

#define NEED(p) do { if (!(p)) { fprintf(stderr, "rank %d: %s\n", mgpu_dist_rank(), mgpu_last_error()); mgpu_dist_abort(1); } } while (0)

int main(int argc, char** argv) {
    mgpu_device_set *device, *cpu;
    mgpu_allreduce* sum;
    mgpu_tensor* rows;
    int rank, size, mine;
    float total;
    NEED(mgpu_dist_init(&argc, &argv) == MGPU_OK);
    rank = mgpu_dist_rank();
    size = mgpu_dist_size();
    NEED(device = mgpu_device_set_create("auto"));   /* this rank's GPU (its local rank's), or the CPU */
    printf("rank %d of %d, local rank %d of %d on this machine, device %s\n", rank, size, mgpu_dist_local_rank(),
           mgpu_dist_local_size(), mgpu_device_set_spec(device));
    /* this rank's rows: BATCH/size each, the first BATCH%size ranks one more */
    mine = BATCH / size + (rank < BATCH % size);
    NEED(cpu = mgpu_device_set_create("cpu"));
    NEED(sum = mgpu_allreduce_create_distributed(cpu, MGPU_ALLREDUCE_AUTO));   /* every rank's CPU device */
    NEED(rows = mgpu_tensor_create(mgpu_device_set_get(cpu, 0), MGPU_F32, mgpu_shape1(1)));
    ((float*)mgpu_tensor_data(rows))[0] = (float)mine;
    NEED(mgpu_allreduce_sum(sum, &rows, 1) == MGPU_OK);   /* collective: every rank calls it */
    total = ((float*)mgpu_tensor_data(rows))[0];
    printf("rank %d: %d rows of mine\n", rank, mine);
    if (total != (float)BATCH) { fprintf(stderr, "rank %d: the rows add up to %g\n", rank, (double)total); mgpu_dist_abort(1); }
    if (rank == 0) printf("the ranks' rows make the batch: %g\n", (double)total);
    mgpu_tensor_destroy(rows);
    mgpu_allreduce_destroy(sum);
    mgpu_device_set_destroy(cpu);
    mgpu_device_set_destroy(device);
    mgpu_dist_shutdown();
    return 0;
}
