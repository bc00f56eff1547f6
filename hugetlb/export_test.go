package hugetlb

// FDInfosRead returns how many fdinfo entries the questions about fenced
// processes have read so far.
func FDInfosRead() int64 { return fdInfos.Load() }
