/*
 * entry.S - the probe's whole ring-0 part.
 *
 * Why so little: under PVM, guest ring-0 code is instruction-emulated (about
 * 2 M instructions/s) while ring 3 runs natively. So everything that can be
 * data is data, built by the assembler (page tables, GDT, IDT, TSS); the boot
 * path is about 40 instructions; and afterwards ring 0 only runs the timer
 * handler and the system calls, a handful of instructions each.
 *
 * System calls trap with UD2, not INT: PVM turns INT n from ring 3 into #UD
 * (seen: int $0x80 and $0x81, interrupt or trap gate, all arrive as vector
 * 6), while exceptions from ring 3 reach our IDT intact. So ring 3 calls
 * sys_call below, whose UD2 the #UD handler recognises by its address.
 *
 * Entry (Linux 64-bit boot protocol): long mode, the VMM's paging and GDT,
 * interrupts off, rsi = boot_params. We switch to our own tables and iretq
 * into probe_main (probe.c) in ring 3 with IF=1.
 *
 * Ring 3 reaches COM1 and the i8042 through the TSS I/O permission bitmap,
 * not through RFLAGS.IOPL=3: PVM keeps IOPL at 0 in ring 3 (in/out there
 * raised #GP even after iretq or popf set IOPL=3) but honours the bitmap.
 */
#include "probe.h"

#define KERNEL_BASE	0x100000	/* = isr_table, asserted by probe.ld */
#define KCODE		0x08
#define KDATA		0x10
#define UDATA		0x18
#define UCODE		0x20
#define TSS_SEL		0x28
#define RFLAGS_USER	0x202		/* IF=1, reserved bit 1 */

/* ISR slots for the non-exception vectors, as offsets from isr_table. */
#define ISR_TIMER	0x200
#define ISR_SPURIOUS	0x240

	.code64

/*
 * Interrupt handlers at fixed addresses, so the IDT can be a constant: the
 * assembler cannot split a relocatable address into gate fields, but it can
 * split KERNEL_BASE + a known offset.
 */
	.section .text.isr, "ax"
	.globl isr_table
isr_table:
	/* Vectors 0-31: 16-byte stubs at isr_table + 16 * vec. The CPU pushes an
	   error code for some vectors only; the others push 0 so every frame looks
	   the same to fault_entry. #UD goes to isr_ud first: it may be a call. */
	.set vec, 0
	.rept 32
	.if vec == 6
	jmp	isr_ud
	.else
	.if !(vec == 8 || (vec >= 10 && vec <= 14) || vec == 17 || vec == 21 || vec == 29 || vec == 30)
	pushq	$0
	.endif
	pushq	$vec
	jmp	fault_entry
	.endif
	.org	isr_table + 16 * (vec + 1)	/* errors out if a stub outgrows its slot */
	.set vec, vec + 1
	.endr

	.org	isr_table + ISR_TIMER
isr_timer:	/* vector 0x20, LAPIC timer: count, EOI, return. Only rax is used. */
	incq	ticks(%rip)
	push	%rax
	xor	%eax, %eax
	movabs	%eax, LAPIC_BASE + 0xB0	/* EOI; movabs: 0xFEE000B0 is no signed disp32 */
	pop	%rax
	iretq

	.org	isr_table + ISR_SPURIOUS
isr_spurious:	/* vector 0xFF: the LAPIC wants no EOI for it */
	iretq

	.text
/* void sys_call(u64 nr, u64 arg), called from ring 3 (probe.c); the
   handler clobbers only rax. */
	.globl sys_call
sys_call:
sys_trap:
	ud2
	ret

isr_ud:		/* vector 6, entered with IF=0 (interrupt gate) */
	cmpq	$sys_trap, (%rsp)	/* saved rip */
	jne	4f
	addq	$2, (%rsp)		/* return past the UD2 */
	cmp	$SYS_TIMER, %rdi
	je	2f
	/* SYS_IDLE: halt until rsi more ticks have been counted. */
	mov	ticks(%rip), %rax
	add	%rsi, %rax		/* rax = tick count to wake at */
1:	cmp	%rax, ticks(%rip)
	jae	3f
	sti				/* STI shadow: no tick slips in before HLT */
	hlt				/* the timer handler returns here with IF=1 */
	cli
	jmp	1b
2:	/* SYS_TIMER: the initial count starts the periodic timer (1 count = 1 ns). */
	mov	%esi, %eax
	movabs	%eax, LAPIC_BASE + 0x380
3:	iretq
4:	pushq	$0			/* a real #UD */
	pushq	$6
	jmp	fault_entry

fault_entry:	/* stack: vec, err, rip, cs, rflags, rsp, ss */
	mov	(%rsp), %rdi
	mov	8(%rsp), %rsi
	mov	16(%rsp), %rdx
	mov	%cr2, %rcx
	and	$-16, %rsp
	call	fault_report		/* probe.c: prints FAULT, resets, never returns */

	.globl _start
_start:
	mov	$kstack_top, %esp
	mov	%rsi, %rbx		/* boot_params, becomes probe_main's argument */

	/* SMEP/SMAP would stop ring 0 from touching our all-user pages. */
	mov	%cr4, %rax
	and	$~((1 << 20) | (1 << 21)), %rax
	mov	%rax, %cr4
	mov	$pml4, %eax
	mov	%rax, %cr3
	lgdt	gdt_ptr(%rip)
	lidt	idt_ptr(%rip)

	/* The TSS base is the one address the assembler cannot place in a
	   descriptor for us (it is below 4 GiB, so bits 63:32 stay 0). */
	mov	$tss, %eax
	mov	%ax, gdt_tss + 2(%rip)
	shr	$16, %eax
	mov	%al, gdt_tss + 4(%rip)
	mov	%ah, gdt_tss + 7(%rip)

	/* Reload CS (far return) and the data segments from our GDT. */
	pushq	$KCODE
	lea	1f(%rip), %rax
	push	%rax
	lretq
1:	mov	$KDATA, %eax
	mov	%eax, %ss
	xor	%eax, %eax
	mov	%eax, %ds
	mov	%eax, %es
	mov	%eax, %fs
	mov	%eax, %gs
	mov	$TSS_SEL, %eax
	ltr	%ax

	/* LAPIC: enable with spurious vector 0xFF, mask LINT0 (no PIC interrupts
	   wanted), timer periodic on vector 0x20 at divide-by-1. The count, and
	   so the frequency, comes later from ring 3 (SYS_TIMER) after it has
	   parsed probe.hz: parsing here would cost emulated instructions. */
	mov	$LAPIC_BASE, %eax
	movl	$0x1FF, 0xF0(%rax)
	movl	$0x10700, 0x350(%rax)
	movl	$0xB, 0x3E0(%rax)
	movl	$0x20020, 0x320(%rax)

	/* To ring 3. rsp is 8 below a 16-byte boundary, as after a call. */
	pushq	$(UDATA | 3)
	pushq	$(ustack_top - 8)
	pushq	$RFLAGS_USER
	pushq	$(UCODE | 3)
	pushq	$probe_main
	mov	%rbx, %rdi
	iretq

	.data
	.balign 16
gdt:
	.quad	0
	.quad	0x00AF9A000000FFFF	/* 0x08 kernel code, 64-bit */
	.quad	0x00CF92000000FFFF	/* 0x10 kernel data */
	.quad	0x00CFF2000000FFFF	/* 0x18 user data, DPL 3 */
	.quad	0x00AFFA000000FFFF	/* 0x20 user code, 64-bit, DPL 3 */
gdt_tss:				/* 0x28 64-bit TSS, 16 bytes, base set by _start */
	.word	tss_end - tss - 1, 0
	.byte	0, 0x89, 0, 0
	.long	0, 0
gdt_end:

gdt_ptr:
	.word	gdt_end - gdt - 1
	.quad	gdt
idt_ptr:
	.word	idt_end - idt - 1
	.quad	idt

/* An interrupt gate to KERNEL_BASE + off (see the fixed slots above). */
.macro gate off, attr, ist=0
	.word	(KERNEL_BASE + \off) & 0xFFFF
	.word	KCODE
	.byte	\ist, \attr
	.word	(KERNEL_BASE + \off) >> 16
	.long	0, 0
.endm

	.balign 16
idt:
	.set vec, 0
	.rept 32
	.if vec == 8
	gate	(16*vec), 0x8E, 1	/* #DF on its own stack (IST1) */
	.else
	gate	(16*vec), 0x8E
	.endif
	.set vec, vec + 1
	.endr
	gate	ISR_TIMER, 0x8E		/* 0x20 */
	.skip	(0xFF - 0x21) * 16	/* not present: would show up as FAULT vec=11 */
	gate	ISR_SPURIOUS, 0x8E	/* 0xFF */
idt_end:

	.balign 16
tss:
	.long	0
	.quad	kstack_top		/* RSP0: stack for interrupts from ring 3 */
	.quad	0, 0, 0			/* RSP1, RSP2, reserved */
	.quad	dfstack_top		/* IST1 */
	.quad	0, 0, 0, 0, 0, 0, 0	/* IST2-7, reserved */
	.word	0, iomap - tss
iomap:	/* one bit per port from 0, 1 = denied; ports past the limit are denied */
	.fill	0x60 / 8, 1, 0xFF
	.byte	0xEF			/* 0x64: i8042 command (reset) */
	.fill	0x3F8 / 8 - 0x60 / 8 - 1, 1, 0xFF
	.byte	0x00			/* 0x3F8-0x3FF: COM1 */
	.byte	0xFF			/* the CPU reads 2 bytes; this one ends the map */
tss_end:

/*
 * Page tables: identity map of 0-4 GiB in 2 MiB pages, all with U/S set so
 * ring 3 can reach everything (boot_params, cmdline, workload, tick counter).
 * The top GiB holds only MMIO (LAPIC, IOAPIC) and is mapped uncached.
 */
	.balign 4096
pml4:
	.quad	pdpt + 0x7		/* present, writable, user */
	.skip	511 * 8
pdpt:
	.quad	pd + 0x0000 + 0x7, pd + 0x1000 + 0x7, pd + 0x2000 + 0x7, pd + 0x3000 + 0x7
	.skip	508 * 8
pd:
	.set addr, 0
	.rept 2048
	.if addr < 0xC0000000
	.quad	addr + 0x87		/* present, writable, user, 2 MiB page */
	.else
	.quad	addr + 0x9F		/* ... and PWT|PCD: uncached */
	.endif
	.set addr, addr + 0x200000
	.endr

	.bss
	.balign 16
	.globl ticks
ticks:	.skip	8			/* timer ticks since SYS_TIMER; ring 3 may read it */
	.balign 4096
	.skip	4096
kstack_top:
	.skip	4096
dfstack_top:
	.skip	16384
ustack_top:

	.section .note.GNU-stack, "", @progbits
