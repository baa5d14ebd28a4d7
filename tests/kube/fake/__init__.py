"""A Kubernetes cluster for the tests, in this process: the API server (`apiserver`), and a kubelet
(`kubelet`) that runs the pods it is given as local processes."""
