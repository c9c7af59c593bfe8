"""Teacher context (step 4): which demonstration a response gets (the first successful peer, never
itself), thinking stripped from it, the teacher's prompt text with feedback, and a teacher prompt over
max_reprompt_len shortened in its demonstration, not in its question."""
from conftest import defaults

import models
import train


def test_the_demonstration_is_the_first_successful_peer_never_the_response_itself():
    rewards = [0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [train.pick_peer(rewards, 4, i, 1.0, True) for i in range(4)] == [1, 2, 1, 1]
    assert train.pick_peer(rewards, 4, 1, 1.0, False) == 1  # self allowed
    assert all(train.pick_peer(rewards, 4, i, 1.0, True) is None for i in range(4, 8))


def test_thinking_is_stripped_from_a_demonstration_closed_or_not():
    assert train.strip_thinking("<think>long\nthought</think>\\boxed{3}") == "\\boxed{3}"
    assert train.strip_thinking("answer <think>never closed") == "answer"


def test_stray_think_closing_tag_drops_what_precedes_it():
    assert train.strip_thinking("reasoning the template opened</think>\\boxed{3}") == "\\boxed{3}"
    assert train.strip_thinking("<think>a</think>x<think>b</think>y") == "xy"
    assert train.strip_thinking("answer <think>never closed") == "answer"
    # the template opened the block and the answer has a <think> of its own after it: the reasoning still goes
    assert train.strip_thinking("reasoning the template opened</think>\\boxed{3} <think>x</think>") == "\\boxed{3}"
    assert train.strip_thinking("reasoning</think>\\boxed{3}\n<think>again, never closed") == "\\boxed{3}"
    assert train.strip_thinking("reasoning</think>more reasoning</think>\\boxed{3}") == "\\boxed{3}"  # no fragment, no tag


def test_teacher_context_text_for_a_hand_made_group():
    cfg = dict(defaults(), use_feedback=True, feedback_only_without_solution=True)
    tasks = [{"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}], "answer": "4"}]
    texts = ["<think>hm</think>\\boxed{4}", "\\boxed{5}", "\\boxed{6}"]
    rewards, feedbacks = [1.0, 0.0, 0.0], [None, "Your final answer 5 is wrong.", "Your final answer 6 is wrong."]
    ctx = train.teacher_contexts(tasks, texts, rewards, feedbacks, 3, cfg)
    assert ctx[0] is None  # the only success: no other peer, and no feedback on a success
    assert ctx[1][0] == {"role": "system", "content": "S"}  # system message untouched
    assert ctx[1][1]["content"] == ("Q?\n\nCorrect solution:\n\n\\boxed{4}\n\nCorrectly solve the original question.")
    assert tasks[0]["messages"][1]["content"] == "Q?"  # the task itself is not mutated
    # feedback always (not only without a solution)
    cfg["feedback_only_without_solution"] = False
    ctx = train.teacher_contexts(tasks, texts, rewards, feedbacks, 3, cfg)
    assert ctx[2][1]["content"] == ("Q?\n\nCorrect solution:\n\n\\boxed{4}\n\nThe following is feedback from your "
                                    "unsuccessful earlier attempt:\n\nYour final answer 6 is wrong.\n\n"
                                    "Correctly solve the original question.")
    # no success in the group: feedback only, or nothing without use_feedback
    ctx = train.teacher_contexts(tasks, texts, [0.0] * 3, feedbacks, 3, cfg)
    assert ctx[0] is None and "Correct solution" not in ctx[1][1]["content"] and "answer 5" in ctx[1][1]["content"]
    cfg["use_feedback"] = False
    assert train.teacher_contexts(tasks, texts, [0.0] * 3, feedbacks, 3, cfg) == [None] * 3


def test_a_teacher_prompt_over_max_reprompt_len_keeps_the_system_turn_and_the_question(toy_data):
    """Cutting an over-long teacher prompt from the left dropped the system turn and the question;
    the demonstration is shortened instead (to its end, where the answer is)."""
    import os
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer"))
    cfg = defaults()
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "12+30"}]
    peer = "step " * 60 + "\\boxed{42}"
    full = models.prompt_ids(tok, train.teacher_messages(messages, peer, None, cfg))
    limit = len(full) - 40
    (ids, short), cut = train.template_teacher_prompts(tok, [{"messages": messages}] * 2, [(peer, None), None], 1, cfg, limit)
    assert cut == 1 and short is None and len(ids) <= limit
    text = tok.decode(ids)
    assert text.startswith(tok.decode(full[:8])) and "Answer briefly." in text and "12+30" in text
    assert text.endswith(tok.decode(full[-12:])) and "\\boxed{42}" in text  # the instruction and the answer stay
    (same, _), cut = train.template_teacher_prompts(tok, [{"messages": messages}], [(peer, None)] * 2, 2, cfg, len(full))
    assert cut == 0 and same == full
    # a limit that leaves no token of the demonstration: the prompt around an empty one, not the full prompt's tail
    empty = models.prompt_ids(tok, train.teacher_messages(messages, "", None, cfg))
    (ids,), cut = train.template_teacher_prompts(tok, [{"messages": messages}], [(peer, None)], 1, cfg, len(empty))
    assert cut == 1 and ids == empty and "Answer briefly." in tok.decode(ids) and "12+30" in tok.decode(ids)


def test_long_feedback_is_shortened_to_its_end_and_keeps_the_system_turn_and_the_question(toy_data):
    """Feedback (a code test's input and output) too long for the limit even without a demonstration was
    cut with the prompt's left end (fit_prompt's last resort): the system turn and the question went.
    The feedback is shortened instead, to its end, where the failure is said."""
    import os
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(os.path.join(toy_data, "toy", "tokenizer"))
    cfg = dict(defaults(), use_feedback=True)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "12+30"}]
    feedback = "Test 3 failed (wrong answer).\nInput:\n" + "1 2 3 4 5 6 7 8 9\n" * 6 + "Expected:\n7\nGot:\n8"
    full = models.prompt_ids(tok, train.teacher_messages(messages, None, feedback, cfg))
    for peer in (None, "\\boxed{42}"):
        (ids,), cut = train.template_teacher_prompts(tok, [{"messages": messages}], [(peer, feedback)], 1, cfg, len(full) - 60)
        text = tok.decode(ids)
        assert cut == 1 and len(ids) <= len(full) - 60
        assert "Answer briefly." in text and "12+30" in text and "Got:\n8" in text, text
        assert text.endswith(tok.decode(full[-12:]))  # the instruction and the generation prefix stay


def test_a_success_whose_answer_is_all_thinking_is_not_a_demonstration():
    """The checkers score an answer inside <think>; stripped, that success demonstrates nothing: the next
    successful peer is the demonstration, not an empty one (and with none, no demonstration)."""
    cfg = defaults()
    texts = ["<think>so the answer is \\boxed{4}", "<think>2+2=4</think>The answer is \\boxed{4}.", "\\boxed{5}", "\\boxed{3}"]
    scored = [train.reward("math", t, "4") for t in texts]
    assert [s for s, _ in scored] == [1.0, 1.0, 0.0, 0.0]
    inputs = train.teacher_inputs(texts, [s for s, _ in scored], [f for _, f in scored], 4, cfg)
    demo = "The answer is \\boxed{4}."
    assert [x and x[0] for x in inputs] == [demo, None, demo, demo]  # row 1's only other success is all thinking
    alone = train.teacher_inputs(texts[:1] + texts[2:] + ["\\boxed{1}"], [1.0, 0.0, 0.0, 0.0], [None, "x", "x", "x"], 4, cfg)
    assert all(x is None for x in alone)
