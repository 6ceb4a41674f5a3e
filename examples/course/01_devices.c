/* examples/course/01_devices.c - lesson 01: which devices are there, and how they are named.

   PyTorch asks torch.cuda.is_available() and torch.cuda.device_count(), then picks a "current"
   GPU with torch.cuda.set_device. mgpu has no current device: you make a device SET from a
   spec string ("cpu", "cpu:4", "cuda:0,1", "auto") and hand its devices to whatever should run
   on them. This program:
     1. counts the GPUs (0 in a CPU build, or on a machine without one),
     2. makes the set the command line names and prints each device,
     3. checks that the set is what the spec says (count, kind, GPU numbers),
     4. puts one tensor on each device, always saying which device, and checks it landed there,
     5. shows the error a spec naming a GPU that does not exist gives.

   Run:   ./01_devices            ("auto": every GPU, or the CPU)
          ./01_devices cpu:4      (four CPU devices: try multi-GPU code on a laptop)
          MGPU_EMU_DEVICES=2 build/emu/01_devices cuda:0,1     (two emulated GPUs) */
// course-run:
// course-run: cpu:4
// course-run-emu 2: cuda:0,1
// course-run-emu 1: cuda:0,0
// course-expect: devices ok
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures = 0;
static void check(int ok, const char* what) {
    if (!ok) { printf("WRONG: %s\n", what); failures++; }
}

int main(int argc, char** argv) {
    const char* spec = argc > 1 ? argv[1] : "auto";
    const char* resolved;
    mgpu_device_set* set;
    int gpus, n, i;

    /* 1. is there a GPU, how many (torch.cuda.is_available(), torch.cuda.device_count()) */
    gpus = mgpu_cuda_device_count();
    printf("GPUs visible to this program: %d%s\n", gpus, gpus == 0 ? " (training would run on the CPU)" : "");

    /* 2. a set of devices, from a spec string */
    set = mgpu_device_set_create(spec);
    if (!set) { printf("%s\n", mgpu_last_error()); return 1; }
    n = mgpu_device_set_count(set);
    resolved = mgpu_device_set_spec(set);   /* "auto" resolved: "cpu" or "cuda:0,1,..." */
    printf("spec '%s' is '%s': %d device(s)\n", spec, resolved, n);
    for (i = 0; i < n; ++i) {
        mgpu_device_info info;
        mgpu_device_get_info(mgpu_device_set_get(set, i), &info);
        if (info.kind == MGPU_DEVICE_CUDA) printf("  device %d: %-8s on GPU %d, %s\n", i, info.label, info.ordinal, info.name);
        else printf("  device %d: %-8s the CPU (host memory)\n", i, info.label);
    }

    /* 3. the set is what its resolved spec says: "cpu" one CPU device, "cpu:N" N of them,
          "cuda:A,B,..." one device per number, device i on GPU number i of the list */
    if (strncmp(resolved, "cuda", 4) == 0) {
        const char* p = strchr(resolved, ':');
        for (i = 0; i < n; ++i) {
            mgpu_device* d = mgpu_device_set_get(set, i);
            mgpu_device_info info;
            mgpu_device_get_info(d, &info);
            check(mgpu_device_kind_of(d) == MGPU_DEVICE_CUDA, "a cuda spec made a CPU device");
            check(p != NULL && info.ordinal == atoi(p + 1), "device i is not on the i-th GPU of the spec");
            check(info.ordinal < gpus, "a device on a GPU that the count does not know");
            if (p) p = strchr(p + 1, ',');
        }
        check(p == NULL, "fewer devices than GPU numbers in the spec");
    } else {
        int want = strncmp(resolved, "cpu:", 4) == 0 ? atoi(resolved + 4) : 1;
        check(n == want, "cpu:N did not make N devices");
        for (i = 0; i < n; ++i)
            check(mgpu_device_kind_of(mgpu_device_set_get(set, i)) == MGPU_DEVICE_CPU, "a cpu spec made a GPU device");
        /* the first CPU device of any set is the library's own CPU device */
        check(mgpu_device_set_get(set, 0) == mgpu_device_cpu(), "device 0 of a cpu set is mgpu_device_cpu()");
    }

    /* 4. devices are passed explicitly: each tensor is made ON a device you name, nothing
          depends on a "current" device. Device i's tensor holds i + 1. */
    for (i = 0; i < n; ++i) {
        mgpu_device* d = mgpu_device_set_get(set, i);
        mgpu_tensor* t = mgpu_tensor_create(d, MGPU_F32, mgpu_shape1(4));
        float back[4] = { 0 };
        if (!t) { printf("%s\n", mgpu_last_error()); return 1; }
        mgpu_tensor_fill(t, i + 1.0);   /* runs on t's device, whichever that is */
        mgpu_tensor_download(t, back, sizeof back);
        check(mgpu_tensor_device(t) == d, "a tensor is not on the device it was made on");
        check(back[0] == i + 1.0f && back[3] == i + 1.0f, "a tensor does not hold what was put there");
        mgpu_tensor_destroy(t);
    }

    /* 5. a GPU that is not there: no set, and the last error says why */
    {
        mgpu_device_set* none = mgpu_device_set_create("cuda:9");
        printf("cuda:9 -> %s\n", none ? "a set?" : mgpu_last_error());
        check(none == NULL && mgpu_last_result() == MGPU_ERROR_NO_DEVICE, "cuda:9 made a set");
        mgpu_device_set_destroy(none);
    }

    mgpu_device_set_destroy(set);
    if (failures) return 1;
    printf("devices ok\n");
    return 0;
}
