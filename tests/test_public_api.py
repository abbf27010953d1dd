"""The public API is small on purpose and changes only by decision: each package's ``__all__`` is
written out here, every name in it is importable, and the package namespace exposes nothing else
(submodules aside). Changing a line here is changing the contract: record why in the docs."""

from __future__ import annotations

import importlib
import inspect

import pytest

ERRORS_PAYLOAD = """PayloadChecksumError PayloadDtypeError PayloadError PayloadFieldError
    PayloadHeaderError PayloadIOError PayloadIndexError PayloadInputError PayloadMediaError
    PayloadMissingFileError PayloadOutputBoundError PayloadPathError PayloadRegionError
    PayloadSegmentError PayloadStaleFileError PayloadStoreAuthError PayloadStoreTimeoutError
    PayloadTruncatedError PayloadWidthError RaggedRowsError StepRecordError UnknownFieldError"""
PUBLIC = {
    "rollfeed.payload": f"""PAYLOAD_FIELDS PayloadField register_field lookup_field PayloadSegment
        RaggedLayout clip_segments shift_segments PayloadWriter PayloadRoot read_field read_fields
        FieldRead RaggedRows canonical_rows MediaRef ImageSpan MediaWriter read_media
        ImageProcessorSpec StepRecord StepRecordIndex StepRecordFile StepRecordWriter
        is_store_url {ERRORS_PAYLOAD}""",
    "rollfeed.collate": """Sample PlanConfig Topology prepare_batch plan_lengths place_micro_batch
        BatchPlan MicroBatch TensorMicroBatch to_tensor_micro_batch IGNORE_INDEX CollateError
        BatchConfigError DuplicateFieldError SupportSetError MeshAxisError OverlongError
        RaggedRows RaggedRowsError SampleDtypeError SampleLengthError SampleValueError
        SegmentRangeError LossRuns StepCounts StepLoss ImageRuns MediaBatch ImageInputError
        SharedPrefixes SharedPrefixError PrefixTree TreeSpan TreeBatch token_versions
        oldest_version""",
    "rollfeed.loaders": """Topology RolloutDataset MicroBatchSampler MicroBatchCollator
        build_dataloader LoaderConfig LoaderOptions RolloutLoader RolloutIterator read_step_file
        write_step_file step_file_name StepWriter LoaderError LoaderConfigError LoaderStateError
        EmptyStepError PlanMismatchError StepFileError StepTimeoutError StepMissingError
        StepReplacedError StepWriteError WorkerError WorkerDiedError WorkerStoppedError
        WorkerTimeoutError StaleSampleError""",
    "rollfeed.models": """support_logprobs fused_support_logprobs SupportScores PolicyScorer CPGroup
        RouterReplay Routing ModelError LMHeadError SupportInputError SupportLabelError
        VocabularyRangeError TemperatureError PackingError UnpackableAttentionError
        RoutingReplayError UlyssesShapeError CPGroupError CPMismatchError NonFiniteLogitError
        GradientReductionError sum_gradients save_checkpoint CheckpointWriteError""",
    "rollfeed.capture": """CaptureConfig capture_sampling_params check_sampling_params check_engine
        capture_request_output capture_completion CapturedCompletion SupportCapture LogprobRows
        logprob_rows support_from_logprob_rows support_from_native_mask align_routed_experts
        routed_dtype Turn assemble_turns CaptureError CaptureModeError RoutingShapeError
        SamplingSettingsError SupportBoundError SupportMembershipError TurnGapError
        TurnRangeError CaptureServerError CaptureRoute GenerateRequest GenerateResponse
        CompletionRecord ServerInfo TurnCapture TurnPrefixError CaptureRequestError
        ModelPathError Checkpoint CheckpointError read_checkpoint WeightUpdater WeightReloadError
        WeightsRequest WeightsResponse engine_version_spans stitch_version_spans""",
    "rollfeed.orchestrator": """CaptureClient Rollout OpenAIRollouts Producer ProducerConfig Prompt
        RolloutCursor TrainerProgress read_progress write_progress group_advantages
        OrchestratorError CursorCorruptError CursorInUseError CursorMismatchError
        CursorWriteError ProgressFileError""",
    "rollfeed.objectives": """SupportDistribution support_distribution micro_batch_rows policy_loss
        PolicyTerms PPOClip ScoreCentering SequenceWeight TokenWeight Unweighted TruncatedIS
        MaskedIS TrustRegion finish_metrics ObjectiveError ObjectiveInputError
        ObjectiveCompositionError ObjectiveMissingInputError NoSamplerLogprobError
        ObjectiveOverflowError aggregate AGGREGATIONS VersionLag""",
}


@pytest.mark.parametrize("package", sorted(PUBLIC))
def test_each_package_exports_exactly_its_frozen_public_names(package):
    module = importlib.import_module(package)
    assert sorted(module.__all__) == sorted(PUBLIC[package].split())
    exposed = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    }
    assert exposed == set(module.__all__), "names reachable from the package but not public"
    for name in module.__all__:
        assert getattr(module, name) is not None
