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
