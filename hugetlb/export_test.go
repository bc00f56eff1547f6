package hugetlb

// FDInfosRead returns how many fdinfo entries the questions about fenced
// processes have read so far.
func FDInfosRead() int64 { return fdInfos.Load() }

// MapsLinesRead returns how many lines of maps files the questions about
// processes have read.
func MapsLinesRead() int64 { return mapsLines.Load() }
