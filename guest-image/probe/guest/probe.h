/*
 * probe.h - the contract between the ring-0 part (entry.S) and the ring-3
 * part (probe.c). Only #defines, so the assembler can include it too.
 */
#ifndef PROBE_H
#define PROBE_H

/* System calls: ring 3 calls sys_call(nr, arg) (entry.S), which traps. */
#define SYS_IDLE  0   /* arg = timer ticks to spend halted */
#define SYS_TIMER 1   /* arg = LAPIC initial count: starts the periodic timer */

#define LAPIC_BASE 0xFEE00000

#endif
