package cache

import (
	"fmt"
	"sync/atomic"
)

// MRInfo describes one registered memory region.
type MRInfo struct {
	Offset    uint64  `json:"offset"` // of its record in the segment
	List      int     `json:"list"`   // memseg list, -1 for external memory
	Start     uint64  `json:"start"`
	Len       uint64  `json:"len"`
	PageSize  uint64  `json:"page_size"`
	BaseIdx   uint32  `json:"base_index"`
	PagesSet  uint32  `json:"pages_registered"`
	BitmapLen uint32  `json:"bitmap_len"`
	LKey      uint32  `json:"lkey"`
	RKey      uint32  `json:"rkey"`
	Chunks    []Entry `json:"chunks"`
}

// Dump is the global cache's state, for operators and tools.
type Dump struct {
	DevGen     uint32      `json:"dev_gen"`
	MRs        []MRInfo    `json:"mrs"`
	FreeMRs    []MRInfo    `json:"free_mrs"`
	Table      []Entry     `json:"table"`
	TableSize  int         `json:"table_size"`
	Overflowed bool        `json:"overflowed"`
	Stats      GlobalStats `json:"stats"`
}

// Dump reads the MR list, the free list and the table under the read lock
// (again if a writer fenced the read meanwhile).
func (g *Global) Dump() (Dump, error) {
	var d Dump
	err := g.readLocked(func() error {
		var err error
		d, err = g.dumpLocked()
		return err
	})
	if err != nil {
		return d, fmt.Errorf("cache: dump: %w", err)
	}
	return d, nil
}

func (g *Global) dumpLocked() (Dump, error) {
	// Empty lists, not missing ones, for the JSON of operators' tools.
	d := Dump{DevGen: atomic.LoadUint32(g.devGen), Stats: g.Stats(), MRs: []MRInfo{}, FreeMRs: []MRInfo{}, Table: []Entry{}}
	err := g.eachMR(atomic.LoadUint64(&g.root.MRList), func(m mr) bool {
		d.MRs = append(d.MRs, m.info())
		return true
	})
	if err != nil {
		return d, err
	}
	if err := g.eachMR(atomic.LoadUint64(&g.root.FreeList), func(m mr) bool {
		d.FreeMRs = append(d.FreeMRs, m.info())
		return true
	}); err != nil {
		return d, err
	}
	t, err := g.table()
	if err != nil {
		return d, err
	}
	d.Table, d.TableSize, d.Overflowed = t.Entries(), t.Size(), t.Overflowed()
	return d, nil
}

// info describes m.
func (m mr) info() MRInfo {
	r := m.rec
	return MRInfo{Offset: m.off, List: int(atomic.LoadInt32(&r.List)), Start: atomic.LoadUint64(&r.Start),
		Len: atomic.LoadUint64(&r.Len), PageSize: atomic.LoadUint64(&r.PageSize),
		BaseIdx: atomic.LoadUint32(&r.BaseIdx), PagesSet: atomic.LoadUint32(&r.PagesSet),
		BitmapLen: atomic.LoadUint32(&r.BitmapLen), LKey: atomic.LoadUint32(&r.LKey),
		RKey: atomic.LoadUint32(&r.RKey), Chunks: m.chunks()}
}
