"""What crosses between the user's process and the workers, and how rows get there: requests'
plans and what comes back (:mod:`~vlens.runtime.transfer.messages`), tensors through shared memory
and CUDA IPC (:mod:`~vlens.runtime.transfer.shared_tensors`), host memory both processes map
(:mod:`~vlens.runtime.transfer.host_blocks`), kept rows streamed into the host's cache as steps end
(:mod:`~vlens.runtime.transfer.host_stream`) by the GPU's copy engines
(:mod:`~vlens.runtime.transfer.pitched_copy`)."""
