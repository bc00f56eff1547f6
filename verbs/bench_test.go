package verbs_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/mpmr/mpmr/internal/sys/vm"
	"github.com/mpmr/mpmr/verbs"
)

// BenchmarkRegDereg2MiB registers and deregisters a 2 MiB region: the
// range check, mlock, the table update and munlock. On tmpfs the kernel
// walks 512 small pages three times; a hugepage is one page, and mlock
// leaves it alone.
func BenchmarkRegDereg2MiB(b *testing.B) {
	run := func(b *testing.B, buf *buffer) {
		_, pd, _ := newSoft(b, 64)
		b.ReportAllocs()
		for b.Loop() {
			mr, err := pd.RegMR(buf.addr, 2<<20, verbs.AccessLocalWrite)
			if err != nil {
				b.Fatal(err)
			}
			if err := pd.DeregMR(mr); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("tmpfs", func(b *testing.B) { run(b, newBuffer(b, 2<<20)) })
	b.Run("hugetlbfs", func(b *testing.B) {
		buf := newHugeBuffer(b)
		if buf.size != 2<<20 {
			b.Skipf("default hugepage size is %d bytes, not 2 MiB", buf.size)
		}
		run(b, buf)
	})
}

// BenchmarkValidate checks one element of a live MR (target: at most
// 20 ns, no allocation).
func BenchmarkValidate(b *testing.B) {
	d, pd, o := newSoft(b, 4096)
	buf := newBuffer(b, vm.PageSize)
	mr, err := pd.RegMR(buf.addr, buf.size, verbs.AccessLocalWrite)
	require.NoError(b, err)
	sge := verbs.SGE{Addr: buf.addr + 64, Len: 128, Key: mr.LKey}
	run := func(b *testing.B, d *verbs.Soft) {
		b.ReportAllocs()
		for b.Loop() {
			if err := d.Validate(sge, verbs.AccessLocalWrite); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.Run("owner", func(b *testing.B) { run(b, d) })
	view := attachSoft(b, o)
	b.Run("attached", func(b *testing.B) { run(b, view) })
	b.Run("stale", func(b *testing.B) {
		stale := sge
		stale.Key++
		b.ReportAllocs()
		for b.Loop() {
			if d.Validate(stale, 0) == nil {
				b.Fatal("stale key validated")
			}
		}
	})
}

// BenchmarkCopy4KiB is a loopback DMA of one page between two MRs.
func BenchmarkCopy4KiB(b *testing.B) {
	d, pd, _ := newSoft(b, 64)
	buf := newBuffer(b, 2*vm.PageSize)
	src, err := pd.RegMR(buf.addr, vm.PageSize, 0)
	require.NoError(b, err)
	dst, err := pd.RegMR(buf.page(1), vm.PageSize, verbs.AccessLocalWrite)
	require.NoError(b, err)
	s := verbs.SGE{Addr: src.Addr, Len: uint32(vm.PageSize), Key: src.LKey}
	t := verbs.SGE{Addr: dst.Addr, Len: uint32(vm.PageSize), Key: dst.LKey}
	b.SetBytes(int64(vm.PageSize))
	b.ReportAllocs()
	for b.Loop() {
		if err := d.Copy(t, s); err != nil {
			b.Fatal(err)
		}
	}
}
