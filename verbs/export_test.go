package verbs

import "sync/atomic"

// The words of the segment any process of the user may write, as tests
// forge them.

// SlotWords returns the Key, PD, Uses and Holes words of the slot key
// names.
func (d *Soft) SlotWords(key uint32) (k, pd, uses, holes *uint32) {
	s := &d.table[key>>variantBits]
	return &s.Key, &s.PD, &s.Uses, &s.Holes
}

// ForgeNextPD writes the header's NextPD word.
func (d *Soft) ForgeNextPD(v uint32) { atomic.StoreUint32(&d.hdr.NextPD, v) }

// SlotKey returns the key the uses-th registration in slot idx gets.
func SlotKey(idx, uses uint32) uint32 { return idx<<variantBits | variantOf(uses) }
