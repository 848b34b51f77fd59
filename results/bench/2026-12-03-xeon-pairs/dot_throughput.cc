#include <chrono>
#include <cstdio>
#define R8(I,A) I " %%" A "20, %%" A "21, %%" A "0\n\t" I " %%" A "20, %%" A "21, %%" A "1\n\t" I " %%" A "20, %%" A "21, %%" A "2\n\t" I " %%" A "20, %%" A "21, %%" A "3\n\t" I " %%" A "20, %%" A "21, %%" A "4\n\t" I " %%" A "20, %%" A "21, %%" A "5\n\t" I " %%" A "20, %%" A "21, %%" A "6\n\t" I " %%" A "20, %%" A "21, %%" A "7\n\t" I " %%" A "20, %%" A "21, %%" A "8\n\t" I " %%" A "20, %%" A "21, %%" A "9\n\t" I " %%" A "20, %%" A "21, %%" A "10\n\t" I " %%" A "20, %%" A "21, %%" A "11\n\t" I " %%" A "20, %%" A "21, %%" A "12\n\t" I " %%" A "20, %%" A "21, %%" A "13\n\t" I " %%" A "20, %%" A "21, %%" A "14\n\t" I " %%" A "20, %%" A "21, %%" A "15\n\t"
#define LOOP(NAME, I, A) double NAME(long n){ auto t0=std::chrono::steady_clock::now(); \
  asm volatile("1:\n\t" R8(I,A) "dec %0\n\tjnz 1b" : "+r"(n) :: "memory","xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11","xmm12","xmm13","xmm14","xmm15","xmm20","xmm21"); \
  return std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); }
LOOP(dy,"vpdpbusd","ymm")
LOOP(dz,"vpdpbusd","zmm")
LOOP(fy,"vfmadd231ps","ymm")
LOOP(fz,"vfmadd231ps","zmm")
LOOP(mb,"vpmaddubsw","ymm")
LOOP(mz,"vpmaddubsw","zmm")
LOOP(wy,"vpmaddwd","ymm")

double imulchain(long n){ long x=3; auto t0=std::chrono::steady_clock::now();
  asm volatile("1:\n\timul %1,%1\n\timul %1,%1\n\timul %1,%1\n\timul %1,%1\n\tdec %0\n\tjnz 1b":"+r"(n),"+r"(x)); 
  return std::chrono::duration<double>(std::chrono::steady_clock::now()-t0).count(); }
int main(){ long n=50000000;
  double cyc = imulchain(n)/(n*12.0);
  printf("GHz %.2f\n", 1e-9/cyc);
  printf("cycles per instr (16 indep): dpbusd ymm %.2f zmm %.2f | fma ymm %.2f zmm %.2f | maddubs ymm %.2f zmm %.2f | maddwd ymm %.2f\n",
   dy(n)/(n*16.0)/cyc, dz(n)/(n*16.0)/cyc, fy(n)/(n*16.0)/cyc, fz(n)/(n*16.0)/cyc, mb(n)/(n*16.0)/cyc, mz(n)/(n*16.0)/cyc, wy(n)/(n*16.0)/cyc);
}
