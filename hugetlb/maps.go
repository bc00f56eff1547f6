package hugetlb

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// describeOccupants names the mappings of this process that overlap
// [start, end), from /proc/self/maps, for an error message.
func describeOccupants(start, end uintptr) string {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return "something (/proc/self/maps unreadable)"
	}
	defer f.Close()
	var found []string
	more := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 2 {
			continue
		}
		lo, hi, ok := strings.Cut(fields[0], "-")
		if !ok {
			continue
		}
		a, err1 := strconv.ParseUint(lo, 16, 64)
		b, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || uintptr(b) <= start || uintptr(a) >= end {
			continue
		}
		if len(found) == 3 {
			more++
			continue
		}
		what := "anonymous memory"
		if len(fields) >= 6 {
			what = strings.Join(fields[5:], " ")
		}
		found = append(found, fmt.Sprintf("[0x%x, 0x%x) %s %s", a, b, fields[1], what))
	}
	if len(found) == 0 {
		return "something (no overlapping entry in /proc/self/maps any more)"
	}
	s := strings.Join(found, ", ")
	if more > 0 {
		s += fmt.Sprintf(" and %d more", more)
	}
	return s
}
