/* The header compiles standalone, and when included twice with the implementation once. */
#include "mgpu.h"
#define MGPU_IMPLEMENTATION
#include "mgpu.h"
#include "mgpu.h"
int main(void) { return mgpu_result_string(MGPU_OK)[0] == 'o' ? 0 : 1; }
