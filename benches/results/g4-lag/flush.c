#include <stddef.h>
#include <stdint.h>
void demote(char *p, size_t n) {
    for (size_t i = 0; i < n; i += 64) __asm__ volatile(".byte 0x0f, 0x1c, 0x00" :: "a"(p + i) : "memory");
}
void flushopt(char *p, size_t n) {
    for (size_t i = 0; i < n; i += 64) __asm__ volatile("clflushopt (%0)" :: "r"(p + i) : "memory");
    __asm__ volatile("sfence" ::: "memory");
}
void wb(char *p, size_t n) {
    for (size_t i = 0; i < n; i += 64) __asm__ volatile("clwb (%0)" :: "r"(p + i) : "memory");
    __asm__ volatile("sfence" ::: "memory");
}
